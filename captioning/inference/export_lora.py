"""``captioning export --format lora``: a model's LoRA adapters alone, in keras-hub's own file
(``Backbone.save_lora_weights``: ``lora/rank`` and each adapted layer's ``lora_kernel_a`` and ``lora_kernel_b`` by
its index among the backbone's layers that hold weights), which ``Backbone.load_lora_weights`` reads into the
preset the model started from — a few hundred kilobytes to share instead of the whole model.

The file is written beside ``output`` and renamed over it when complete; an existing file is replaced only when it
is a LoRA file (``--overwrite``), and one holding these very adapters is left as it is (a rerun is a no-op). The
name must end in ``.lora.h5`` (keras-hub's rule).
"""

from __future__ import annotations

import os

import numpy as np

from captioning.errors import InputError
from captioning.fileio import check_output_file, disk_full_error
from captioning.inference.captioner import Captioner
from captioning.model.ensemble import model_dirs
from captioning.model.folder import ModelDir
from captioning.model.lora import TRAINED_BY

SUFFIX = ".lora.h5"


def _adapters(path: str) -> dict | None:
    """The arrays of the LoRA file at ``path`` (``rank`` and ``INDEX/lora_kernel_a|b``), or None for a file that is
    not one."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            if "lora" not in f:
                return None
            out = {}
            f["lora"].visititems(lambda name, item: out.__setitem__(name, np.asarray(item))
                                 if isinstance(item, h5py.Dataset) else None)
            return out
    except (OSError, ValueError):
        return None


def check_output(output: str, model_dir) -> dict | None:
    """Refuses an ``output`` this export must not write, before the model loads (one line): a name without
    ``.lora.h5``, a file of the model folder or its preset, a file that is not a LoRA file. Returns the adapters the
    file holds already, or None."""
    if not output.endswith(SUFFIX):
        raise InputError(f"--output {output}: a LoRA file's name ends in {SUFFIX} (keras-hub's rule)",
                         params=("output",))
    for path in model_dirs(model_dir):
        ModelDir(path).refuse_output(output, "--output", params=("output",))
    check_output_file(output, "--output", params=("output",))
    existing = _adapters(output) if os.path.isfile(output) and os.path.getsize(output) else None
    if os.path.isfile(output) and os.path.getsize(output) and existing is None:
        raise InputError(f"--output {output} exists and is not a LoRA file this command wrote: writing would overwrite "
                         "it; give a new file name", params=("output",))
    return existing


def export_lora(captioner: Captioner, output: str, model_dir, overwrite: bool = False) -> tuple[str, bool]:
    """Writes the LoRA adapters of ``captioner``'s model to ``output`` (module docstring): ``(output, written)``,
    ``written`` false when ``output`` held these adapters already."""
    if len(captioner.trained.members) > 1:
        raise InputError("--format lora writes one model's adapters: give one --model-dir", params=("model_dir",))
    backbone = captioner.trained.model.lora_backbone()
    if backbone is None:
        raise InputError(f"--format lora: the model has no LoRA adapters ({TRAINED_BY})", params=("format",))
    existing = check_output(output, model_dir)
    tmp = f"{output[:-len(SUFFIX)]}.tmp{os.getpid()}{SUFFIX}"
    try:
        backbone.save_lora_weights(tmp)
        if existing is not None:
            written = _adapters(tmp)
            same = written.keys() == existing.keys() and all(np.array_equal(written[k], existing[k]) for k in written)
            if same:
                os.remove(tmp)
                return output, False
            if not overwrite:
                os.remove(tmp)
                raise InputError(f"--output {output} holds other LoRA adapters; pass --overwrite to replace them",
                                 params=("overwrite",))
        os.replace(tmp, output)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise disk_full_error(e, output, "the LoRA file") or e
    return output, True
