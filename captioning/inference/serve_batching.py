"""``captioning serve``'s batching: the images of concurrent requests captioned together, in one model call.

Request threads hand their images to a :class:`Batcher`; one thread of its own makes every model call. It takes
the oldest waiting image, then waits up to ``wait_ms`` milliseconds (``--batch-wait-ms``, default 5) for more
images decoded with the same options, up to ``max_batch`` images (``--max-batch``, default 16), and captions
them in one call of that option set's :class:`~captioning.inference.captioner.Captioner`; each caption goes back
to the request that sent its image. Images of other option sets wait for the next call, oldest first, so no
option set starves another. This is what TF Serving's batching does (``max_batch_size``,
``batch_timeout_micros``: a batch closes when full or when its oldest request has waited that long), with one
batch queue per distinct option set, as TF Serving keeps one per model signature.

Each distinct option set (a :class:`~captioning.config_sections.DecodeConfig`) has its own Captioner (its own
``tf.function``, traced on its first call), kept in a least-recently-used cache of at most
:data:`MAX_CAPTIONERS`; the server's own options (the model's ``decode:`` config and the command's flags) are
always kept. A batch whose call fails (an image TensorFlow cannot decode after Pillow read it) is captioned
again image by image, so one bad image gets its own error and never sinks the others, as ``captioning
caption`` does.

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

from captioning.config_sections import DecodeConfig
from captioning.inference.caption import caption_each
from captioning.inference.captioner import Captioner

log = logging.getLogger("captioning.serve")

MAX_CAPTIONERS = 8  # option sets kept ready at once (each a traced tf.function), the server's own not counted


@dataclasses.dataclass(eq=False)
class _Item:
    """One image waiting for its caption."""

    captioner: Captioner
    data: bytes
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    captions: list | None = None
    error: str | None = None


class Batcher:
    """One model-call thread captioning the images of every request, batched (module docstring).

    ``calls`` counts the model calls made and ``batches`` their sizes (the evidence that concurrent requests
    shared calls); :meth:`stop` ends the thread after the images already handed in."""

    def __init__(self, default: Captioner, max_batch: int = 16, wait_ms: float = 5.0):
        """``default``: the server's own Captioner (its model and options); other option sets get theirs."""
        self.trained, self.default = default.trained, default
        self.max_batch, self.wait = max_batch, wait_ms / 1000.0
        self._captioners: collections.OrderedDict = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._queue: collections.deque[_Item] = collections.deque()
        self._ready = threading.Condition()
        self._stopping = False
        self.calls, self.images, self.batches = 0, 0, collections.Counter()
        self._thread = threading.Thread(target=self._run, name="captioning-serve-model", daemon=True)
        self._thread.start()

    @staticmethod
    def key(decode: DecodeConfig) -> str:
        """What tells option sets apart: every setting's value."""
        return json.dumps(dataclasses.asdict(decode), sort_keys=True)

    def captioner_for(self, decode: DecodeConfig) -> Captioner:
        """The Captioner of an option set, made (and checked: an InputError for a value the model cannot use, e.g. a
        ``bad_endings`` word its vocabulary lacks) on its first use, in the caller's thread."""
        key = self.key(decode)
        if key == self.key(self.default.settings):
            return self.default
        with self._cache_lock:
            captioner = self._captioners.get(key)
            if captioner is None:
                captioner = Captioner(self.trained, decode)
                self._captioners[key] = captioner
                while len(self._captioners) > MAX_CAPTIONERS:
                    self._captioners.popitem(last=False)
            self._captioners.move_to_end(key)
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
            for item, (item.captions, item.error) in zip(batch, caption_each(lambda items: self._call(captioner, items),
                                                                             batch)):
                item.done.set()

    def _call(self, captioner: Captioner, items: list[_Item]) -> list:
        captions = captioner.caption([item.data for item in items])
        self.calls += 1
        self.images += len(items)
        self.batches[len(items)] += 1
        return captions
