"""``captioning serve``: the flags of the web page and JSON API over a trained model or an ensemble (the server
itself is :mod:`captioning.inference.serve`; docs/serving.md explains it)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import re

from captioning.cli.commands import _captioner, _decoding_given, add_model_dirs
from captioning.cli.parsing import batching_flags, decoding_flags, within
from captioning.errors import InputError

log = logging.getLogger("captioning")

MAX_UPLOAD_MB = 1024  # --max-upload-mb: a request's body is read whole into memory
MAX_IMAGES = 1024  # --max-images, per request
MAX_ALLOWED_HOSTS = 16  # --allowed-host, given at most this many times


def host_name(text: str) -> str:
    """An argparse type: a host name (``captions.lan``; its last label begins with a letter, as every top-level
    domain does) or an IP address (``192.168.1.5``, ``[fe80::1]``) as a ``Host`` header names it, without a port;
    lowercased, without brackets or a final dot."""
    name = text.lower().strip("[]").removesuffix(".")
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    labels = name.split(".")
    if len(name) > 253 or not all(re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", label) for label in labels) \
            or not labels[-1][0].isalpha():
        raise argparse.ArgumentTypeError(f"must be a host name or an IP address without a port (captions.lan), "
                                         f"got {text[:60]!r}")
    return name


def add_serve(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve a web page and a JSON API that caption images",
        description="Serves a trained model (several --model-dir: their ensemble) on a web page where you drop or "
                    "pick images and see their captions, scores, top-k alternatives and per-word attention, and "
                    "as a JSON API: POST /caption with multipart fields named image (and decode.KEY options) "
                    "returns the `caption --json` records as a list. Concurrent requests are captioned together "
                    "in one model call. It listens on 127.0.0.1 unless --host says otherwise; there is no "
                    "authentication. Stop it with Ctrl-C or SIGTERM.",
        epilog="example:\n"
               "  captioning serve --model-dir runs/demo/model --port 8000\n"
               "  curl -F image=@a.jpg -F image=@b.jpg -F decode.beam_size=5 http://127.0.0.1:8000/caption",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_dirs(p)
    decoding_flags(p, top_k=True)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface, "
                        "with a warning: there is no authentication)")
    p.add_argument("--port", type=within(0, 65535), default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--allowed-host", action="append", type=host_name, default=[], metavar="NAME",
                   help="a name the server may be reached by besides its address (a request's Host header; any "
                        f"port), e.g. behind a proxy; repeat for more, at most {MAX_ALLOWED_HOSTS}. Requests for "
                        "another Host, and POSTs from another site's page, are refused (403)")
    # the defaults live in captioning.inference.serve_api.Limits (None: not given); importing it here would load
    # TensorFlow for --help
    p.add_argument("--max-upload-mb", type=within(1, MAX_UPLOAD_MB), default=None,
                   help=f"largest request body in MB, at most {MAX_UPLOAD_MB:,}; larger ones are refused (413) "
                        "before they are read (default 32)")
    p.add_argument("--max-images", type=within(1, MAX_IMAGES), default=None,
                   help=f"most images in one request, at most {MAX_IMAGES:,}; more are refused (413) (default 32)")
    batching_flags(p)
    p.set_defaults(handler=run_serve)


def run_serve(args) -> int:
    from captioning.inference.serve import bind, is_loopback, serve_until_stopped, start
    from captioning.inference.serve_api import Limits
    from captioning.model.folder import ModelDir

    _decoding_given(args)  # a wrong option or folder in one line, before the port is taken
    if len(args.allowed_host) > MAX_ALLOWED_HOSTS:
        raise InputError(f"`allowed_host` given {len(args.allowed_host)} times: at most {MAX_ALLOWED_HOSTS}",
                         params=("allowed_host",))
    for path in args.model_dir:
        ModelDir(path).require_trained()
    server = bind(args.host, args.port)  # a port in use or a wrong host: one line, before the model loads
    if not is_loopback(args.host):
        log.warning("listening on %s: anyone who can reach this port can caption images (there is no "
                    "authentication); use --host 127.0.0.1 to serve this machine only", args.host)
    try:
        given = {name: getattr(args, name) for name in ("max_upload_mb", "max_images") if getattr(args, name)}
        running = start(_captioner(args), server=server, limits=Limits(**given),
                        max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms, allowed_hosts=args.allowed_host,
                        title=f"captions by {' + '.join(args.model_dir)}")
    except BaseException:
        server.server_close()
        raise
    print(f"serving {' + '.join(args.model_dir)} on {running.url} (the API: POST {running.url}caption); "
          "Ctrl-C to stop", flush=True)
    serve_until_stopped(running)
    print("stopped", flush=True)
    return 0
