"""Turning a trained model's step function into captions: batched beam search (greedy is beam size 1), and
:func:`generate`, which runs the search ``decode:`` asks for (beam, greedy or sampling).

Every search is one strategy of the one word-by-word loop, :func:`captioning.model.search_loop.search`, whose
docstring states the inference contract: what a decoder's ``step`` must provide (logits for every row, and a state
of row-major tensors the loop repeats per beam and reorders with the beams, so any decoder works unchanged). The
loop runs for a whole batch of images at once inside TensorFlow (wrap it in ``tf.function``), calling the decoder's
``step`` once per word for all beams of all images together. im2txt ran its beam search in Python, one session call
per step and one image at a time (~0.3 s per image). The strategies: :class:`captioning.model.beams.BeamSearch`
(beams and diverse beams), :class:`captioning.model.greedy.Greedy`, :class:`captioning.model.sampling.Sampling`.

Beam search, as im2txt defined it (so that a beam of 1 is exactly greedy decoding):

* each live caption is extended only by its ``beam_size`` most likely next words (im2txt's later code
  expanded almost the whole vocabulary by mistake); ``<pad>`` and ``<start>`` are never proposed;
* an extension by ``<end>`` completes the caption; the ``beam_size`` best other extensions stay live;
* live captions that reach ``max_length`` words without ``<end>`` are complete at that length;
* complete captions are ranked by ``log_prob / penalty(length)`` (``length`` counts the ``<end>`` token):
  ``length_penalty`` ``avg`` (the default) divides by ``length ** α``, ``gnmt`` by Wu et al.'s
  ``((5 + length) / 6) ** α``, ``none`` by 1; α is ``length_normalization`` (0, the default, ranks by the
  summed log-probability itself under any form);
* ``<unk>`` is never proposed either.

Options that shape the captions inside the search (all off by default; a beam of 1 with all of them off is
exactly greedy decoding):

* ``block_ngrams`` n ≥ 1: no word follows itself, and (n ≥ 2) no n-gram occurs twice in a caption — an
  extension that would repeat one is never proposed (Hugging Face's ``no_repeat_ngram_size``, applied
  inside the beam; self-critical.pytorch blocks trigrams in greedy and sampled decoding only);
* ``bad_endings`` (word ids): a caption whose last word is one of them may not end there — ``<end>`` is
  not proposed after it (self-critical.pytorch's ``remove_bad_endings``; a caption reaching
  ``max_length`` words still ends where it is).

Worked example (beam 2): if after "a" the model gives ``red`` -0.2, ``<end>`` -1.9, ``big`` -2.3, the
live captions become "a red" and "a big" (``<end>`` is not among this caption's top 2 words, so "a" does
not complete here).
"""

from __future__ import annotations

from captioning.data.tokenizers import as_tokenizer
from captioning.model.beams import BeamSearch
from captioning.model.greedy import Greedy
from captioning.model.sampling import Sampling
from captioning.model.search_loop import search
from captioning.model.word_rules import bad_ending_ids  # noqa: F401  (the captioner's import)


def beam_search(model, features, beam_size: int = 3, max_length: int = 20, initial_state=None,
                fast_greedy: bool = True, **options) -> dict:
    """Captions for a batch of encoder ``features`` ``[B, D]`` (or from the decoder's ``initial_state``
    for them, when given; ``features`` is then unused). ``options``: ``top_k`` (1), ``length_normalization`` (0),
    ``length_penalty_form`` (``avg``), ``block_ngrams`` (0), ``bad_endings`` (none), ``beam_groups`` (1),
    ``diversity`` (0), ``min_length`` (0), each said below (the module docstring says the first ones), and ``words``
    (None; a subword tokenizer's :class:`~captioning.model.word_rules.WordTable`: n-gram blocking and bad endings over
    its words, :class:`~captioning.model.word_rules.WordRules`).

    Returns ``{"ids": int32 [B, top_k, max_length] (words only, 0-padded), "lengths": int32 [B, top_k]
    (words), "log_probs": float32 [B, top_k] (summed log-probabilities of the words and of <end> when the
    caption completed), "scores": float32 [B, top_k] (the ranking score)}``, best first. A decoder that
    ``attends`` (its state a dict whose ``attention`` entry holds the weights of the step just taken,
    ``[B, G]``) also gets ``"attention": float32 [B, top_k, max_length, G]``: for each word of each caption, the weights
    it was chosen with (kept per beam and reordered with the beams; zeros after the caption's end). A slot
    with no caption (fewer complete captions than ``top_k``) comes last, empty, with log p -1e9.

    ``min_length``: ``<end>`` is not proposed before that many words (Hugging Face's ``min_length``; im2txt
    never let a caption end at its first step): :func:`generate` asks for 1, so a caption is never empty.

    **Diverse beam search** (Vijayakumar et al. 2018, Algorithm 1, as fairseq, Hugging Face and
    self-critical.pytorch run it): ``beam_groups`` G divides the beam into G groups of ``beam_size / G``
    beams, each a beam search of its own, one live caption each at first. At every step the groups choose in
    turn, and a word's log-probability is lowered by ``diversity`` λ times the number of captions of the
    earlier groups that chose it at this step (Hamming diversity; a caption an earlier group completed at
    this step chose ``<end>``). That penalised score is what a group's captions carry forward and are ranked
    by (``scores``); ``log_probs`` stay the model's own. Each group keeps its own complete captions, and the
    ``top_k`` returned come one per group in turn: the groups' best captions first, then their second ones, and
    so on, each round likeliest first by the model's own log-probability (length penalty applied, as one beam
    search ranks its captions; the penalised scores would favour the first group). So ``top_k`` <= G captions
    come from ``top_k`` groups, the first being the likeliest of the groups' best. One group is beam search.

    A beam of 1 runs the :class:`~captioning.model.greedy.Greedy` strategy, a few ops a step that give exactly what
    the beam search of one beam gives (``fast_greedy=False`` runs the beam search itself: tests compare the two).
    Either search stops before ``max_length`` steps once no step can change its result: every caption ended (a beam
    of 1), or, when no length penalty divides the scores, every group holds ``top_k`` complete captions scoring at
    least as well as its best live one (scores only fall as a caption grows).
    """
    return beam_search_counted(model, features, beam_size, max_length, initial_state, fast_greedy, **options)[0]


def beam_search_counted(model, features, beam_size: int = 3, max_length: int = 20, initial_state=None,
                        fast_greedy: bool = True, jit_compile: bool = False, **options):
    """:func:`beam_search`'s captions and the steps it ran (an int32 scalar): ``benchmark decode`` runs its decoder's
    own steps exactly as many times. ``jit_compile``: the search compiled by XLA (a beam of 1 only:
    :func:`captioning.model.search_loop.search`)."""
    BeamSearch.check(beam_size, options.get("top_k", 1), options.get("beam_groups", 1))
    if initial_state is None:
        initial_state = model.initial_state(features, training=False)
    if beam_size == 1 and fast_greedy:
        options = {key: value for key, value in options.items() if key not in ("top_k", "beam_groups", "diversity")}
        strategy = Greedy(model, max_length, **options)
    else:
        strategy = BeamSearch(model, beam_size, max_length, **options)
    return search(model, initial_state, strategy, max_length, jit_compile=jit_compile)


def ids_to_text(vocab, ids, lengths) -> list[list[str]]:
    """Captions as strings from :func:`beam_search`'s ``ids`` and ``lengths`` (numpy or tensors), in the words of
    ``vocab``: a tokenizer (:mod:`captioning.data.tokenizers`: a subword tokenizer's pieces detokenized, its
    :meth:`~captioning.data.tokenizers.base.Tokenizer.text`) or a :class:`captioning.vocab.Vocabulary`."""
    text = as_tokenizer(vocab).text
    ids, lengths = getattr(ids, "numpy", lambda: ids)(), getattr(lengths, "numpy", lambda: lengths)()
    return [[text(row[:length]) for row, length in zip(image_ids, image_lengths)]
            for image_ids, image_lengths in zip(ids, lengths)]


def empty_captions_warning(best) -> str | None:
    """One line saying how many of the best captions ``best`` (strings, one per image) are empty, or None.
    :func:`generate` gives every caption a word; an empty one means something else went wrong, and is never
    silent (``caption`` and ``evaluate`` print this).

    >>> empty_captions_warning(["a red circle", "", " "])
    '2 of 3 best captions are empty (the model ended them before any word): their images are described by nothing'
    """
    best = list(best)
    empty = sum(1 for text in best if not text.strip())
    if not empty:
        return None
    return (f"{empty} of {len(best)} best captions are empty (the model ended them before any word): their images "
            "are described by nothing")


def generate(model, initial_state, settings, bad_endings=(), keys=None, words=None) -> dict:
    """Captions from the decoder's initial state as ``settings`` (a :class:`captioning.config.DecodeConfig`) say, in
    :func:`beam_search`'s format (greedy: a beam of 1; or sampling); ``bad_endings``: what
    :func:`~captioning.model.word_rules.bad_ending_ids` gives, ``keys [B]``: seeds; ``words``: a subword tokenizer's
    :class:`~captioning.model.word_rules.WordTable` (:func:`~captioning.model.word_rules.word_table`), whose words
    n-gram blocking and bad endings then read (None: a word vocabulary's ids)."""
    return generate_counted(model, initial_state, settings, bad_endings, keys, words)[0]


def generate_counted(model, initial_state, settings, bad_endings=(), keys=None, words=None):
    """:func:`generate`'s captions and the steps the search ran (an int32 scalar), and the rows per image it stepped:
    ``(captions, steps ran, rows per image)``."""
    method, arguments = search_arguments(settings)
    if method == "sample":
        jit_compile = arguments.pop("jit_compile")
        strategy = Sampling(model, keys=keys, bad_endings=bad_endings, words=words, **arguments)
        captions, ran = search(model, initial_state, strategy, arguments["max_length"], jit_compile=jit_compile)
        return captions, ran, strategy.rows_per_image
    captions, ran = beam_search_counted(model, None, initial_state=initial_state, bad_endings=bad_endings, words=words,
                                        **arguments)
    return captions, ran, arguments["beam_size"]


def search_arguments(settings) -> tuple[str, dict]:
    """The search :func:`generate` runs for ``settings`` and all it reads of them but ``bad_endings``: the same
    arguments, the same captions and graph (``captioning serve`` keys its decoders so: a beam's seed traces nothing)."""
    common = dict(max_length=settings.max_length, block_ngrams=settings.block_ngrams, min_length=1)
    if settings.method == "sample":
        return "sample", dict(jit_compile=settings.jit_compile, samples=settings.top_k,
                              temperature=settings.temperature, seed=settings.seed,
                              sample_top_k=settings.sample_top_k, sample_top_p=settings.sample_top_p, **common)
    beam = 1 if settings.method == "greedy" else settings.beam_size
    return "beam", dict(beam_size=beam, top_k=1 if settings.method == "greedy" else settings.top_k,
                        length_normalization=settings.length_normalization, length_penalty_form=settings.length_penalty,
                        beam_groups=settings.beam_groups if beam > 1 else 1, diversity=settings.diversity,
                        jit_compile=settings.jit_compile, **common)
