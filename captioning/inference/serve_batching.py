"""``captioning serve``'s batching: the images of concurrent requests captioned together, in one model call.

Request threads hand their images to a :class:`Batcher`; one thread of its own makes every model call. It takes
the oldest waiting image, then waits up to ``wait_ms`` milliseconds (``--batch-wait-ms``, default 5) for more
images decoded with the same options, up to ``max_batch`` images (``--max-batch``, default 16), and captions
them in one call of that option set's :class:`~captioning.inference.captioner.Captioner`; each caption goes back
to the request that sent its image. Images of other option sets wait for the next call, oldest first, so no
option set starves another. This is what TF Serving's batching does (``max_batch_size``,
``batch_timeout_micros``: a batch closes when full or when its oldest request has waited that long), with one
batch queue per distinct option set, as TF Serving keeps one per model signature.

Each option set that decodes differently has its own Captioner (its own ``tf.function``, traced on its first
call): option sets are told apart by what the search reads of them
(:func:`captioning.model.decode.search_arguments`, and ``bad_endings``), so a ``decode.seed`` under beam search,
which nothing reads, is the server's own Captioner. At most :data:`MAX_CAPTIONERS` are kept besides the server's
own (always kept), least recently used dropped first; but one used within the last :data:`IDLE_S` seconds is
never dropped for a new one: a request whose options would need a new trace then is refused
(:class:`OptionSetsBusy`, HTTP 503), so a client cycling options causes at most about :data:`MAX_CAPTIONERS`
traces a :data:`IDLE_S` seconds, not one a request. A batch whose call fails with an image's error (an image
TensorFlow cannot decode after Pillow read it) is captioned again image by image, so one bad image gets its own
error and never sinks the others, as ``captioning caption`` does; any other failure of the model call (out of
memory) is the server's: logged once with its cause, and each request of the batch gets :class:`ModelError`
(HTTP 500).

>>> batcher = Batcher(Captioner(trained), max_batch=16, wait_ms=5)       # doctest: +SKIP
>>> captions = batcher.caption(batcher.captioner_for(decode), [jpeg_bytes])   # doctest: +SKIP
>>> batcher.calls, batcher.stop()                               # doctest: +SKIP
(1, None)
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time

from captioning.config.sections import DecodeConfig
from captioning.inference.caption import caption_each
from captioning.inference.captioner import Captioner
from captioning.model.decode import search_arguments

log = logging.getLogger("captioning.serve")

MAX_CAPTIONERS = 8  # option sets kept ready at once (each a traced tf.function), the server's own not counted
IDLE_S = 60.0  # a Captioner used within this many seconds is not dropped for a new option set


class OptionSetsBusy(Exception):
    """A new option set refused: every kept Captioner was used too recently to drop (HTTP 503)."""


class ModelError(Exception):
    """The model call failed for a reason that is not an image's (HTTP 500); its ``__cause__`` is the error."""


@dataclasses.dataclass(eq=False)
class _Item:
    """One image waiting for its caption."""

    captioner: Captioner
    data: bytes
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    captions: list | None = None
    error: str | None = None
    failure: BaseException | None = None  # the model call's own error (not an image's)


class Batcher:
    """One model-call thread captioning the images of every request, batched (module docstring).

    ``calls`` counts the model calls made and ``batches`` their sizes (the evidence that concurrent requests
    shared calls); :meth:`stop` ends the thread after the images already handed in."""

    def __init__(self, default: Captioner, max_batch: int = 16, wait_ms: float = 5.0):
        """``default``: the server's own Captioner (its model and options); other option sets get theirs."""
        self.trained, self.default = default.trained, default
        self.max_batch, self.wait = max_batch, wait_ms / 1000.0
        self._captioners: collections.OrderedDict = collections.OrderedDict()  # key -> (Captioner, last use)
        self.max_captioners, self.idle_s = MAX_CAPTIONERS, IDLE_S
        self._cache_lock = threading.Lock()
        self._queue: collections.deque[_Item] = collections.deque()
        self._ready = threading.Condition()
        self._stopping = False
        self.calls, self.images, self.batches = 0, 0, collections.Counter()
        self._thread = threading.Thread(target=self._run, name="captioning-serve-model", daemon=True)
        self._thread.start()

    @staticmethod
    def key(decode: DecodeConfig) -> str:
        """What tells option sets apart: what the search reads of them (:func:`search_arguments`) and the words
        captions may not end with."""
        return json.dumps([search_arguments(decode), sorted(set(decode.bad_endings))], sort_keys=True)

    def captioner_for(self, decode: DecodeConfig) -> Captioner:
        """The Captioner of an option set, made (and checked: an InputError for a value the model cannot use, e.g. a
        ``bad_endings`` word its vocabulary lacks) on its first use, in the caller's thread; an
        :class:`OptionSetsBusy` when it is new and every kept one was used within :attr:`idle_s` seconds."""
        key = self.key(decode)
        if key == self.key(self.default.settings):
            return self.default
        with self._cache_lock:
            now = time.monotonic()
            captioner = self._captioners.pop(key, (None, 0.0))[0]
            if captioner is None:
                if len(self._captioners) >= self.max_captioners:
                    oldest, (_, used) = next(iter(self._captioners.items()))
                    if now - used < self.idle_s:
                        raise OptionSetsBusy(
                            f"{len(self._captioners)} other sets of decoding options were used in the last "
                            f"{self.idle_s:g} s, each kept traced: try again in {self.idle_s - (now - used):.0f} s, "
                            "or use options already in use (or the server's own)")
                    del self._captioners[oldest]
                captioner = Captioner(self.trained, decode)
            self._captioners[key] = (captioner, now)  # the most recently used last
            return captioner

    def caption(self, captioner: Captioner, images: list[bytes]) -> list[tuple[list | None, str | None]]:
        """Per image (bytes the model reads: JPEG or PNG), ``(captions, None)`` or ``(None, error)``; blocks until
        all are captioned, in as many model calls as the batching makes."""
        items = [_Item(captioner, data) for data in images]
        with self._ready:
            if self._stopping:
                raise RuntimeError("the server is stopping")
            self._queue.extend(items)
            self._ready.notify()
        for item in items:
            item.done.wait()
        failed = next((item.failure for item in items if item.failure is not None), None)
        if failed is not None:  # TensorFlow's messages start with where the graph ran: its first line of its own
            said = next((line for line in map(str.strip, str(failed).splitlines()) if line and not line.startswith(
                ("Graph execution error", "Detected at node", "File ", "[[", "Hint:"))), "")[:200]
            raise ModelError(f"the model failed: {type(failed).__name__}" + (f": {said}" if said else "")) from failed
        return [(item.captions, item.error) for item in items]

    def stop(self) -> None:
        """Ends the model thread once the images handed in are captioned."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
        self._thread.join()

    def _next_batch(self) -> list[_Item] | None:
        """The oldest image and up to ``max_batch - 1`` more of its option set, waiting at most ``wait`` seconds
        from the moment the oldest was taken for the batch to fill; None when stopping with nothing left."""
        with self._ready:
            while not self._queue:
                if self._stopping:
                    return None
                self._ready.wait()
            first = self._queue.popleft()
            batch, deadline = [first], time.monotonic() + self.wait
            while len(batch) < self.max_batch:
                same = [item for item in self._queue if item.captioner is first.captioner]
                for item in same[:self.max_batch - len(batch)]:
                    self._queue.remove(item)
                    batch.append(item)
                left = deadline - time.monotonic()
                if len(batch) >= self.max_batch or left <= 0 or self._stopping:
                    break
                self._ready.wait(left)
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            captioner = batch[0].captioner  # one undecodable image must not sink the batch: caption_each
            try:
                done = caption_each(lambda items: self._call(captioner, items), batch)
            except Exception as e:  # the model's failure, not an image's: logged once here, each request a 500
                log.error("a model call failed (%d image(s)): every request in it gets an error 500", len(batch),
                          exc_info=True)
                done = [(None, None)] * len(batch)
                for item in batch:
                    item.failure = e
            for item, (item.captions, item.error) in zip(batch, done):
                item.done.set()

    def _call(self, captioner: Captioner, items: list[_Item]) -> list:
        captions = captioner.caption([item.data for item in items])
        self.calls += 1
        self.images += len(items)
        self.batches[len(items)] += 1
        return captions
