"""A server's address as a setting takes it (``data.service``, ``--dispatcher``): ``HOST:PORT``, checked when the
config loads, before any network or TensorFlow (:mod:`captioning.data.service_probe` asks whether something
answers there).

A parameter is named in messages as the library does (```service```, rewritten to the flag by the
command line); a config key (it has a dot: ``data.service``) as it is.
"""

from __future__ import annotations

import re

from captioning.errors import InputError, excerpt

ADDRESS = re.compile(r"(?:grpc://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?):(\d{1,5})")


def named(param: str) -> str:
    """How a message names ``param``: a config key (``data.service``) as it is, a parameter marked for
    :class:`InputError` (```service```)."""
    return param if "." in param else f"`{param}`"


def params_of(param: str) -> tuple[str, ...]:
    return () if "." in param else (param,)


def parse_address(text: str, param: str = "service") -> tuple[str, int]:
    """``HOST:PORT`` (``grpc://`` allowed in front, IPv6 hosts in brackets) as ``(host, port)``; an
    :class:`InputError` naming ``param`` otherwise.

    >>> parse_address("grpc://data0:5050")
    ('data0', 5050)
    >>> parse_address("[::1]:5050", "dispatcher")
    ('[::1]', 5050)
    >>> parse_address("data0", "dispatcher")
    Traceback (most recent call last):
    ...
    captioning.errors.InputError: `dispatcher` must look like HOST:PORT, e.g. data0:5050, got 'data0'
    """
    match = ADDRESS.fullmatch(text.strip())
    if not match or not 1 <= int(match[2]) <= 65535:
        raise InputError(f"{named(param)} must look like HOST:PORT, e.g. data0:5050, got {excerpt(text)}",
                         params=params_of(param))
    return match[1], int(match[2])


def is_loopback(host: str) -> bool:
    """Whether ``host`` (as :func:`parse_address` returns it) names this machine's loopback interface."""
    return host.strip("[]") in ("localhost", "::1") or host.startswith("127.")
