"""``captioning data-service dispatcher|worker``: TensorFlow's tf.data service servers, whose workers do
a trainer's input processing on other machines (:mod:`captioning.data.service` has the library, the
trainer's side and what happens when a server is lost). Each server logs its address, serves until
SIGTERM or SIGINT, then stops and exits 0. Usage errors (a port in use, a malformed address, a work dir
that cannot be written, no dispatcher answering) are one line and exit code 2, before TensorFlow loads.
"""

from __future__ import annotations

import argparse

from captioning.cli.parsing import call, within
from captioning.config.settings import MAX_SECONDS


def _port(low: int):
    """An argparse type: a TCP port number from ``low`` to 65535."""
    def parse(text: str) -> int:
        if not text.isdigit() or not low <= int(text) <= 65535:
            raise argparse.ArgumentTypeError(f"must be a port number from {low} to 65535, got {text!r}")
        return int(text)

    parse.__name__ = "port"
    return parse


def add_data_service(sub) -> None:
    p = sub.add_parser(
        "data-service", help="run a tf.data service dispatcher or worker (input processing on other machines)",
        description="Runs one of TensorFlow's tf.data service servers. One dispatcher coordinates; workers run "
                    "the trainers' input pipelines and send them the elements. Start the dispatcher first, then "
                    "the workers; trainers pass the dispatcher's HOST:PORT to captioning.data.service.distribute. "
                    "Each server logs its address and runs until SIGTERM or SIGINT (exit 0).",
        epilog="example, on three machines:\n"
               "  data0$ captioning data-service dispatcher --port 5050 --work-dir /shared/ds-work\n"
               "  data1$ captioning data-service worker --dispatcher data0:5050 --port 5051\n"
               "  data2$ captioning data-service worker --dispatcher data0:5050 --port 5051",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    servers = p.add_subparsers(dest="server", metavar="SERVER", required=True)

    q = servers.add_parser(
        "dispatcher", help="the one dispatcher: registers datasets, makes jobs, assigns workers",
        description="Runs the tf.data service dispatcher on --port (all interfaces) until SIGTERM or SIGINT. With "
                    "--work-dir it journals its state there before answering any request, so a dispatcher "
                    "restarted with the same --port and --work-dir carries on and the trainers' streams continue; "
                    "without one, a restart forgets every job and the trainers fail.")
    q.add_argument("--port", type=_port(1), required=True,
                   help="TCP port to listen on; workers and trainers connect to HOST:PORT")
    q.add_argument("--work-dir", metavar="DIR",
                   help="folder (or gs:// URL) for the dispatcher's journal, on storage that survives the machine; "
                        "created if missing. Gives fault tolerance: a restart resumes every job (default: none)")
    q.set_defaults(handler=run_dispatcher)

    q = servers.add_parser(
        "worker", help="a worker: runs the trainers' input pipelines, serves their elements",
        description="Runs a tf.data service worker for the dispatcher at --dispatcher until SIGTERM or SIGINT. "
                    "It waits at most --timeout seconds for the dispatcher to answer, then registers; the "
                    "dispatcher gives trainers this worker's --host and --port.")
    q.add_argument("--dispatcher", required=True, metavar="HOST:PORT",
                   help="the dispatcher's address, as it logs it, e.g. data0:5050")
    q.add_argument("--port", type=_port(0), default=0,
                   help="TCP port to serve elements on (default 0: any free port). Give a fixed port so that a "
                        "restarted worker comes back at the same address and takes its old task back")
    q.add_argument("--host", metavar="NAME",
                   help="the name trainers reach this machine by (default: localhost when the dispatcher is on "
                        "localhost, else this machine's host name)")
    q.add_argument("--timeout", dest="timeout_s", type=within(1, MAX_SECONDS, float), default=60.0, metavar="SECONDS",
                   help="how long to wait for the dispatcher to answer before giving up (default 60)")
    q.add_argument("--heartbeat", dest="heartbeat_s", type=within(0.1, MAX_SECONDS, float), default=None, metavar="SECONDS",
                   help="how often to report its tasks and that it is alive to the dispatcher (default: "
                        "TensorFlow's, 30)")
    q.set_defaults(handler=run_worker)


def run_dispatcher(args) -> int:
    from captioning.data import service as data_service
    from captioning.fileio import check_output_folder

    if args.work_dir is not None:  # not empty, not a file: before a server starts
        check_output_folder(args.work_dir, "`work_dir`", params=("work_dir",))
    call(data_service.run_dispatcher, args)
    return 0


def run_worker(args) -> int:
    from captioning.data import service as data_service

    call(data_service.run_worker, args)
    return 0
