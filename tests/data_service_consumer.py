"""A trainer's input side for tests/test_data_service.py: reads ``range(N)`` mapped on the tf.data service
workers through :func:`captioning.data.service.distribute` and prints one line per element,
``ELEMENT x square worker`` (the square computed on the worker as the sum of the first x odd numbers;
the worker named by the ``worker.txt`` in the worker process's folder, read there), then ``END``.
An error becomes one line on stderr, ``captioning: error: ...``, and its exit code.

    python tests/data_service_consumer.py --service localhost:5050 --mode distributed_epoch --n 101
"""

import argparse
import contextlib
import sys
import time

from captioning.tf_import import import_tensorflow_quietly

import_tensorflow_quietly()  # stderr: only the error line, if any

import tensorflow as tf  # noqa: E402

from captioning.data import service as data_service  # noqa: E402
from captioning.errors import InputError  # noqa: E402


def squares(n: int) -> tf.data.Dataset:
    def work(x):  # runs on a worker: x² the long way, and the worker's name from its own folder
        return x, tf.reduce_sum(2 * tf.range(x) + 1), tf.io.read_file("worker.txt")

    return tf.data.Dataset.range(n).map(work)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--service", required=True)
    parser.add_argument("--mode", default="distributed_epoch")
    parser.add_argument("--n", type=int, default=101)
    parser.add_argument("--job-name")
    parser.add_argument("--dataset-id")
    parser.add_argument("--timeout", type=float, default=60.0, help="distribute's timeout_s")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds per element, as a training step")
    parser.add_argument("--watch", type=float, default=None, help="watch_dispatcher's timeout_s (interval 1 s)")
    args = parser.parse_args()
    watch = (data_service.watch_dispatcher(args.service, timeout_s=args.watch, interval_s=1.0) if args.watch
             else contextlib.nullcontext())
    try:
        with watch:
            dataset = data_service.distribute(squares(args.n), args.service, args.mode, args.job_name,
                                              dataset_id=args.dataset_id, timeout_s=args.timeout)
            for x, square, worker in dataset:
                print("ELEMENT", int(x), int(square), worker.numpy().decode(), flush=True)
                time.sleep(args.delay)
    except InputError as e:
        print(f"captioning: error: {e}", file=sys.stderr)
        return e.exit_code
    except tf.errors.OpError as e:
        error = data_service.service_error(e, args.service)
        if error is None:
            raise
        print(f"captioning: error: {error}", file=sys.stderr)
        return error.exit_code
    print("END", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
