"""One TensorFlow in the installed venv (setup.cfg, README.md's Installing).

keras-hub requires tensorflow-text, and tensorflow-text requires the `tensorflow` distribution, so the venv
must hold `tensorflow` and not `tensorflow-cpu`: both write the one top-level `tensorflow` package, and with
both installed the files on disk are whichever wheel was unpacked last, while uninstalling either deletes
files the other still lists. These tests read the running venv (importlib.metadata, ``pip check``): no
network, no install.

Checked against the layouts these tests exist to catch (fresh venvs, 2026-11-25):

- the install before keras-hub came in (tensorflow-cpu, no keras-hub): three fail. The one provider of
  `tensorflow` is tensorflow-cpu, tensorflow-cpu is installed, keras_hub does not import. ``pip check`` passes.
- that venv with keras-hub added by hand (the mistake setup.cfg's choice avoids): two fail. Two
  distributions, tensorflow and tensorflow-cpu, provide `tensorflow`, while ``pip check`` passes: every
  requirement is met, twice over, which is why the provider count is checked apart from ``pip check``.
- keras-hub and tensorflow-text without the `tensorflow` distribution: ``pip check`` fails ("tensorflow-text
  2.21.1 requires tensorflow, which is not installed").
"""

import importlib
import importlib.metadata
import subprocess
import sys


def _provides_tensorflow(dist: importlib.metadata.Distribution) -> bool:
    """Whether the distribution installs the top-level `tensorflow` package: its RECORD lists
    tensorflow/__init__.py, or its top_level.txt names `tensorflow`."""
    files = dist.files or []
    if any(str(f).replace("\\", "/") == "tensorflow/__init__.py" for f in files):
        return True
    top_level = dist.read_text("top_level.txt") or ""
    return "tensorflow" in top_level.split()


def _name(dist: importlib.metadata.Distribution) -> str:
    return dist.metadata["Name"].lower().replace("_", "-")


def test_exactly_one_distribution_provides_tensorflow():
    providers = sorted({_name(d) for d in importlib.metadata.distributions() if _provides_tensorflow(d)})
    assert providers == ["tensorflow"], f"distributions installing the `tensorflow` package: {providers}"


def test_tensorflow_cpu_is_not_installed():
    names = {_name(d) for d in importlib.metadata.distributions()}
    assert "tensorflow-cpu" not in names
    assert "tensorflow" in names


def test_keras_hub_and_tensorflow_text_import():
    """The versions setup.cfg asks for, importable (tensorflow-text's release follows TensorFlow's)."""
    keras_hub = importlib.import_module("keras_hub")
    tensorflow_text = importlib.import_module("tensorflow_text")
    assert keras_hub.__version__.startswith("0.32.")
    tf_minor = importlib.metadata.version("tensorflow").split(".")[:2]
    assert importlib.metadata.version("tensorflow-text").split(".")[:2] == tf_minor == ["2", "21"]
    assert callable(keras_hub.models.Backbone.from_preset)
    assert hasattr(tensorflow_text, "WordpieceTokenizer")


def test_pip_check_is_clean():
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No broken requirements found" in result.stdout
