"""Several trained models decoding as one: at every step each model's next-word distribution, averaged.

An :class:`Ensemble` is what beam search, sampling, evaluation's perplexity and the export ask of a model
(``vocab_size``, ``attends``, ``image_state``, ``reserve``, ``step``, ``logits_and_penalty``), built from
models that share a tokenizer (a word vocabulary, or one language model's pieces: ``prefix_lm`` models of the
same ``model.decoder_preset`` tokenizer) and may otherwise differ in everything: decoders (Show and Tell, attention,
Transformer, Up-Down, prefix_lm, mixed), sizes, seeds, encoders, image sizes. Its decoding state is the tuple of the
members' states, each reordered with the beams like any state nest. Each step's "logits" are the log of
the members' averaged probabilities::

    log p(w) = log (1/M · Σ_m softmax(logits_m)(w))     (a logsumexp of the members' log-softmaxes − log M)

which is what self-critical.pytorch's ``AttEnsemble`` does (with equal weights), so log_softmax of them
is p itself and every decoding option applies to the ensemble unchanged. (The meshed-memory Transformer's
``TransformerEnsemble`` averages the members' log-softmax outputs instead, a geometric mean; on the shapes
data that gave the same CIDEr, docs/using.md.) Teacher-forced, the same average gives the ensemble's
cross-entropy on the references (its perplexity in ``evaluate``).

An ensemble reports no attention weights (its members' grids or regions need not be alike).

Worked example: two models give "red" 0.6 and 0.2 and "blue" 0.3 and 0.7; the ensemble gives "red" 0.4
and "blue" 0.5, so greedy decoding says "blue" where the first model alone said "red".

:func:`load_ensemble` reads the model folders (:class:`captioning.model.folder.ModelDir`) and refuses, in
one line, models whose vocabularies differ, or whose tokenizers do (a word model with a ``prefix_lm`` one, or two
``prefix_lm`` models whose presets tokenize differently: naming both).
"""

from __future__ import annotations

import dataclasses
import math
import os

import tensorflow as tf

from captioning.config import Config
from captioning.errors import InputError
from captioning.model.folder import ModelDir, TrainedModel
from captioning.vocab import Vocabulary


class Ensemble(tf.Module):
    """Models of one vocabulary as one model of it (see the module docstring). A ``tf.Module``: a SavedModel
    of it holds every member's variables."""

    attends = False  # the members' attention may be over different grids: none is reported
    token_layout = None

    def __init__(self, models):
        super().__init__(name="ensemble")
        models = list(models)
        if len(models) < 2:
            raise ValueError(f"an ensemble needs at least 2 models, got {len(models)}")
        sizes = {m.vocab_size for m in models}
        if len(sizes) != 1:
            raise ValueError(f"the models' vocabulary sizes differ: {sorted(sizes)}")
        self.members = models
        self.vocab_size = models[0].vocab_size

    def image_state(self, inputs, training=False):
        """Each member's decoding state of the batch's images (:meth:`CaptionModel.image_state`), as a tuple."""
        return tuple(m.image_state(inputs, training) for m in self.members)

    def reserve(self, state, steps):
        return tuple(m.reserve(s, steps) for m, s in zip(self.members, state))

    def _average(self, logits):
        """The log of the members' averaged probabilities, from their logits ``[..., V]``."""
        logp = tf.stack([tf.nn.log_softmax(tf.cast(x, tf.float32)) for x in logits])
        return tf.reduce_logsumexp(logp, axis=0) - math.log(len(logits))

    def step(self, token_ids, state):
        """One step of every member: the averaged distribution's log (as logits ``[B, V]``) and the states."""
        steps = [m.step(token_ids, s) for m, s in zip(self.members, state)]
        return self._average([logits for logits, _ in steps]), tuple(s for _, s in steps)

    def logits_and_penalty(self, inputs, training=False, split_padding=False, sampling=None):
        """Teacher-forced: the averaged distribution's log ``[N, T, V]`` and no penalty (zeros ``[N]``).
        ``sampling`` (scheduled sampling's, which the evaluation loss passes as None): an ensemble never trains."""
        if sampling is not None:
            raise ValueError("an ensemble is not trained: no scheduled sampling")
        logits = [m.logits_and_penalty(inputs, training=training, split_padding=split_padding)[0]
                  for m in self.members]
        return self._average(logits), tf.zeros([tf.shape(inputs["input_ids"])[0]])

    def __call__(self, inputs, training=False, split_padding=False):
        return self.logits_and_penalty(inputs, training=training, split_padding=split_padding)[0]


@dataclasses.dataclass
class TrainedEnsemble:
    """Trained models of several folders as one (:class:`TrainedModel`'s fields; ``config``, ``step``,
    ``checkpoint`` and ``model_dir`` are the first member's: its folder keeps the ensemble's evaluations,
    and its ``decode:`` section is the default decoding)."""

    members: list[TrainedModel]
    model: Ensemble

    @property
    def config(self) -> Config:
        return self.members[0].config

    @property
    def vocab(self) -> Vocabulary:
        return self.members[0].vocab

    @property
    def step(self) -> int:
        return self.members[0].step

    @property
    def checkpoint(self) -> str:
        return self.members[0].checkpoint

    @property
    def model_dir(self) -> str:
        return self.members[0].model_dir

    @property
    def preprocessor(self):
        """The first member's image preprocessor (each member crops with its own when it captions)."""
        return self.members[0].preprocessor


def describe_tokenizer(tokenizer) -> str:
    """A tokenizer as a refusal names it: a word vocabulary, or a language model's (its identity), and its ids."""
    kind = getattr(tokenizer, "kind", "words")
    what = "a word vocabulary" if kind == "words" else f"the {kind} tokenizer {tokenizer.identity}"
    return f"{what} of {len(tokenizer)} ids"


def check_vocabularies(named) -> None:
    """An InputError in one line when the tokenizers of ``named`` (pairs of model folder and tokenizer,
    :mod:`captioning.data.tokenizers`; a word vocabulary is one) are not all the first one's: models of
    different tokenizers (a word decoder and a ``prefix_lm``, or two language models' presets that split text
    differently) give probabilities over different id spaces, which cannot be averaged."""
    (first, words), *rest = named
    for path, other in rest:
        if getattr(other, "kind", "words") != "words" or getattr(words, "kind", "words") != "words":
            if other != words:
                raise InputError(f"the models in {first} and {path} have different tokenizers "
                                 f"({describe_tokenizer(words)}; {describe_tokenizer(other)}): an ensemble averages "
                                 "probabilities over one id space, so its models must share one tokenizer (the "
                                 "same model.decoder_preset's, or the same word vocabulary)", params=("model_dir",))
            continue
        if other != words:
            differ = next((i for i, (a, b) in enumerate(zip(words.words, other.words)) if a != b),
                          min(len(words), len(other)))
            where = (f"word {differ}: {words.words[differ]!r} against {other.words[differ]!r}"
                     if differ < min(len(words), len(other)) else "one is longer")
            raise InputError(f"the models in {first} and {path} have different vocabularies ({len(words)} and "
                             f"{len(other)} words; {where}): an ensemble averages word probabilities, so its "
                             "models must share one vocabulary (prepare their data with the same `--vocab`)",
                             params=("model_dir",))


def model_dirs(model_dir) -> list[str]:
    """A command's ``model_dir`` as a list of folders: one folder (a path), or an ensemble's (a list)."""
    return [model_dir] if isinstance(model_dir, (str, os.PathLike)) else list(model_dir)


def load_ensemble(model_dirs, weights: str | None = None) -> TrainedEnsemble:
    """The latest complete checkpoint of each folder of ``model_dirs`` (at least two), as one model. A folder
    given twice is refused, and the vocabularies are compared, before any model is built. ``weights``: each
    model's (:meth:`captioning.model.folder.ModelDir.use_weights`; None: each one's default, its average when
    its checkpoint has one)."""
    seen = {}
    for path in model_dirs:
        if os.path.realpath(path) in seen:
            raise InputError(f"`model_dir` {path} is given twice (as {seen[os.path.realpath(path)]}): an ensemble's "
                             "models are different folders", params=("model_dir",))
        seen[os.path.realpath(path)] = path
    folders = [ModelDir(path) for path in model_dirs]
    check_vocabularies([(f.path, f.require_trained()[1]) for f in folders])
    members = [f.load(weights=weights) for f in folders]
    return TrainedEnsemble(members, Ensemble([m.model for m in members]))


def check_same_input(members) -> None:
    """An InputError in one line when the trained models ``members`` read different inputs
    (their data sources' :meth:`~captioning.model.data_sources.base.DataSource.evaluation_input`): evaluation
    reads each image once, as all of them read it (``caption`` and ``export`` give each model its own)."""
    first = members[0].model.source.evaluation_input()
    for member in members[1:]:
        other = member.model.source.evaluation_input()
        if other != first:
            differ = ", ".join(f"data.{k} {first.get(k)!r} against {other.get(k)!r}"
                               for k in sorted(set(first) | set(other)) if first.get(k) != other.get(k))
            raise InputError(f"the models in {members[0].model_dir} and {member.model_dir} read different inputs "
                             f"({differ}): an ensemble is evaluated over one input; caption or export it instead, "
                             "where each model reads the images its own way", params=("model_dir",))
