"""Helpers the tests share: real image bytes, free ports, the command line in-process or in a fresh process,
background processes, small configs, a decoder registered from a file. Fixtures are in conftest.py; tests
import these from here (never from conftest)."""

import io
import os
import shutil
import subprocess
import sys

from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_config(**values):
    """A ModelConfig from keyword values, the decoder's own settings (``lstm_units``, ...) among them."""
    from captioning.config import ModelConfig
    from captioning.config.settings import keys_of

    shared = {k: v for k, v in values.items() if k in keys_of(ModelConfig)}
    return ModelConfig(**shared, options={k: v for k, v in values.items() if k not in shared})


def coco_split_args(shapes_dir, splits=("train", "val", "test")):
    return [f"{s}={shapes_dir}/annotations/captions_{s}.json:{shapes_dir}/images" for s in splits]


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def gradient(mode: str = "RGB", size=(48, 32)) -> Image.Image:
    """A small image with real content (so JPEG round trips are meaningful)."""
    w, h = size
    image = Image.new("RGB", size)
    image.putdata([(x * 255 // w, y * 255 // h, 128) for y in range(h) for x in range(w)])
    return image if mode == "RGB" else image.convert(mode)


def huge_jpeg(width: int = 20000, height: int = 10000) -> bytes:
    """A real baseline JPEG of ``width`` x ``height`` (a horizontal gradient), made in milliseconds and
    without ever holding the image: one 8-pixel strip is encoded with a restart marker per MCU row; a
    restart resets the DC predictors, so that row's entropy-coded bytes are the same for every row and
    are repeated (with the RST0…RST7 cycle between them) under a SOF header patched to the full height.
    20000 x 10000 is 200M pixels, past Pillow's decompression-bomb error limit (2 x 89M), in ~6 MB."""
    assert height % 8 == 0
    ramp = Image.linear_gradient("L").rotate(90).resize((width, 8))
    strip = Image.merge("RGB", (ramp, ramp.transpose(Image.Transpose.FLIP_LEFT_RIGHT), Image.new("L", (width, 8), 96)))
    data = encode(strip, "JPEG", quality=90, subsampling=0, restart_marker_rows=1)  # 4:4:4: 8x8 MCUs
    head, pos, restarts = bytearray(data[:2]), 2, False
    while True:  # the marker segments up to and including SOS
        marker, length = data[pos + 1], int.from_bytes(data[pos + 2:pos + 4], "big")
        segment = bytearray(data[pos:pos + 2 + length])
        if marker == 0xC0:  # SOF0: precision, height, width, ...
            segment[5:7] = height.to_bytes(2, "big")
        restarts |= marker == 0xDD  # DRI
        head += segment
        pos += 2 + length
        if marker == 0xDA:
            break
    assert restarts and data.endswith(b"\xff\xd9")
    row = data[pos:-2]
    markers = [bytes([0xFF, 0xD0 + i % 8]) for i in range(height // 8 - 1)] + [b"\xff\xd9"]
    return bytes(head) + b"".join(row + marker for marker in markers)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_main(*args, cwd=None) -> tuple[int, str, str]:
    """The command line in this process (no Python and TensorFlow start-up to pay again): ``(exit code,
    stdout, stderr)``, the log lines in stderr as the command prints them. ``cwd``: the working directory
    during the command."""
    import contextlib
    import logging

    from captioning.cli import main

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    level, before = root.level, os.getcwd()
    root.addHandler(handler)  # main()'s basicConfig adds none when the root has a handler: set its level here
    root.setLevel(logging.DEBUG if "-v" in args else logging.WARNING if "-q" in args else logging.INFO)
    try:
        if cwd:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's usage errors, --help, --version
                code = e.code
    finally:
        os.chdir(before)
        root.removeHandler(handler)
        root.setLevel(level)
    return code, out.getvalue(), err.getvalue()


# what only a process of its own can do: devices and collectives set before TensorFlow starts, servers
# whose loss ends the process (os._exit), environment variables
NEEDS_A_PROCESS = ("distribute.logical_cpus", "distribute.strategy=mirrored", "multi_worker", "data.service",
                   "data-service")


def _config_needs_a_process(args) -> bool:
    """Whether the ``--config`` file of ``args`` sets devices, a cluster or a tf.data service."""
    import yaml

    if "--config" not in args or args.index("--config") + 1 >= len(args):
        return False
    try:
        with open(args[args.index("--config") + 1], encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return False
    distribute, source = data.get("distribute") or {}, data.get("data") or {}
    return bool((distribute.get("logical_cpus") or 0) > 1 or distribute.get("strategy") in ("mirrored", "multi_worker")
                or source.get("service"))


def run_main_into(out_dir, name, *args):
    """:func:`run_main` in a scenario of conftest's ``distributed_runs`` (a command that needs 2 logical CPUs, run in
    the process its MirroredStrategy scenarios share instead of a process of its own): its exit code, stdout and
    stderr written to ``out_dir/NAME.json``, which :func:`main_result` reads back in the test."""
    import json

    code, out, err = run_main(*args)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"args": [str(a) for a in args], "code": code, "stdout": out, "stderr": err}, f)


def main_result(out_dir, name) -> subprocess.CompletedProcess:
    """What :func:`run_main_into` wrote, as :func:`run_cli` returns it."""
    import json

    with open(os.path.join(out_dir, f"{name}.json")) as f:
        got = json.load(f)
    return subprocess.CompletedProcess(["captioning", *got["args"]], got["code"], got["stdout"], got["stderr"])


def run_cli(*args, cwd=None, timeout=300, env=None, process=False):
    """``captioning ARGS``: in this process (:func:`run_main`, seconds faster) unless ``process`` asks for
    a fresh ``python -m captioning`` (signals, kills, resource limits), ``env`` sets variables, or the
    command needs one (:data:`NEEDS_A_PROCESS`, in the arguments or the config file). Returns a
    CompletedProcess either way."""
    args = [str(a) for a in args]
    if process or env or any(p in " ".join(args) for p in NEEDS_A_PROCESS) or _config_needs_a_process(args):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO, **(env or {}))
        return subprocess.run([sys.executable, "-m", "captioning", *args], capture_output=True, text=True,
                              cwd=cwd or REPO, env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    code, out, err = run_main(*args, cwd=cwd or REPO)
    return subprocess.CompletedProcess(["captioning", *args], code, out, err)


class Background:
    """A process in the background (``argv``, run in ``cwd``), its stdout and stderr going to
    ``folder/<name>.out`` and ``.err``, which the properties read as they grow."""

    def __init__(self, folder, name, argv, cwd=None, env=None):
        self.name, self.out_path, self.err_path = name, folder / f"{name}.out", folder / f"{name}.err"
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO, **(env or {}))
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=cwd or REPO, env=env,
                                         stdin=subprocess.DEVNULL)

    @property
    def stdout(self):
        return self.out_path.read_text()

    @property
    def stderr(self):
        return self.err_path.read_text()


def worker_env() -> dict:
    """The environment of a process of tests/distributed_worker.py. Its XLA compilations (the decoders' jit-compiled
    steps, SCST's sampling loop) run at LLVM's lowest optimisation level (``--xla_backend_optimization_level=0``):
    the same graphs and the same HLO passes, code generated in less CPU time (measured on the decoders' compiled
    steps: 10.9 CPU s instead of 18.6 for the four on a loaded machine, 6.3 instead of 7.9 for two on an idle one),
    and results that agree with the default's to float rounding (each weight within 1.2e-7 of the default's after
    the step, measured); how fast the compiled code runs does not matter to a step run a few times."""
    flags = os.environ.get("XLA_FLAGS", "")  # (tests/conftest.py puts the flag in the test processes' environment)
    if "--xla_backend_optimization_level=0" not in flags.split():
        flags = " ".join(f for f in (flags, "--xla_backend_optimization_level=0") if f)
    return dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", XLA_FLAGS=flags)


# tests/test_region_training.py's 2-replica scenarios: an attention model over the oracle store's regions
REGIONS = ("data.features=regions", "data.features_store=oracle", "model.decoder=attention",
           "model.attention_size=8", "model.attention_l1=1.0")


def run_distributed_scenarios(root, groups, timeout=900):
    """Runs each group of ``groups`` (``{"mirrored": [[MODE, DATA_DIR, NAME, ARG...], ...], "multi_worker": [...]}``)
    with tests/distributed_worker.py's ``many``: "mirrored" in one process (2 logical CPUs), "multi_worker" in
    the two workers of a localhost cluster (TF_CONFIG), all at once: one TensorFlow start-up a process for
    every scenario of a group instead of one a scenario. A "mirrored" group given as a tuple of lists of scenarios
    runs each list in a process of its own, at once (the parts balanced against the multi-worker pair, so that the
    processes end together). Scenario NAME writes into ``root/GROUP/NAME``; each process's output goes to
    ``root/GROUP[-TASK].log`` (``root/GROUP-pPART.log`` for the parts), with each scenario's CPU and wall seconds.
    Never raises: :func:`distributed_result` asserts."""
    import json

    procs = []
    for group, scenarios in groups.items():
        parts = scenarios if isinstance(scenarios, tuple) else (scenarios,)
        assert group == "mirrored" or len(parts) == 1, "a multi-worker group runs in one pair of processes"
        for part, scenarios in enumerate(parts):
            name = group if len(parts) == 1 else f"{group}-p{part}"
            spec = os.path.join(root, f"{name}.json")
            with open(spec, "w") as f:
                json.dump([[mode, data, os.path.join(root, group, out), *args] for mode, data, out, *args in scenarios],
                          f)
            tasks = [None] if group == "mirrored" else [0, 1]
            ports = [free_port(), free_port()]
            for task in tasks:
                env = worker_env()
                if task is not None:
                    env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                                   "task": {"type": "worker", "index": task}})
                log = os.path.join(root, name + ("" if task is None else f"-{task}") + ".log")
                with open(log, "w") as out:
                    procs.append(subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "distributed_worker.py"),
                                                   "many", spec], env=env, stdout=out, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL))
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()


def assert_scst_update_as_one_device(r) -> None:
    """A mirrored SCST scenario's ``.npz`` (tests/distributed_worker.py's ``mirrored_grouped``): two replicas drew a
    positive reward and took the loss and update one device took from both batches."""
    import numpy as np
    import pytest

    assert float(r["one_reward"]) > 0 and float(r["two_reward"]) == pytest.approx(float(r["one_reward"]), abs=1e-5)
    assert float(r["two_loss"]) == pytest.approx(float(r["one_loss"]), abs=1e-5)
    names = [k[len("one/"):] for k in r.files if k.startswith("one/")]
    assert len(names) > 10
    for name in names:
        np.testing.assert_allclose(r["two/" + name], r["one/" + name], atol=1e-5, err_msg=name)


def distributed_result(root, group, name):
    """The folder scenario ``name`` of ``group`` wrote (:func:`run_distributed_scenarios`), asserting that it
    finished in every process of its group: else its traceback, or the end of the processes' output."""
    import glob

    out = os.path.join(root, group, name)
    error = os.path.join(out, "error.txt")
    assert not os.path.exists(error), open(error).read()[-4000:]
    tasks = ["one"] if group == "mirrored" else ["0", "1"]
    missing = [t for t in tasks if not os.path.exists(os.path.join(out, f"done-{t}"))]
    logs = "\n".join(f"{log}:\n{open(log).read()[-2500:]}" for log in sorted(glob.glob(os.path.join(root, f"{group}*.log"))))
    assert not missing, f"scenario {group}/{name} did not finish in {missing}\n{logs}"
    return out


def copy_model(model_dir, out) -> str:
    """A copy of a session's trained model folder to change, without its ``eval/`` folder: the results other
    tests' evaluations stored there would be found and reused by a copy's ``evaluate`` (a rerun of a finished
    evaluation is a no-op), so what a test sees would depend on which tests ran before it."""
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("eval"))
    return str(out)


def copies(paths, tmp_path):
    """Copies of model folders, ``tmp_path/m0``, ``m1``, … (an ensemble's evaluate writes into the first)."""
    out = []
    for i, path in enumerate(paths):
        shutil.copytree(path, tmp_path / f"m{i}")
        out.append(str(tmp_path / f"m{i}"))
    return out


def small_train_config(data_dir, *extra):
    """A config that trains in seconds on the shapes fixture (tests/harness/distributed.py's ``small_config``, which
    tests/distributed_worker.py's scenarios use)."""
    from tests.harness.distributed import small_config

    return small_config(data_dir, *extra)


def register_decoder_file(path: str, name: str):
    """Imports the module at ``path`` and registers its ``DECODER`` class as ``name`` in
    ``captioning.model.DECODERS``: what adding a decoder to the project is, one file and one entry."""
    import importlib.util

    from captioning.model import DECODERS

    spec = importlib.util.spec_from_file_location(f"registered_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    DECODERS[name] = module.DECODER
    return module.DECODER
