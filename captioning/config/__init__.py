"""The config: YAML files (``base:``, ``--set``) into typed sections, a base package every stage may import.

* :mod:`.loader` — the loader: reading the files, ``--set``, the checks across sections, ``config.yaml``
  written back (its names are this package's: ``captioning.config.load_config``);
* :mod:`.settings` — the one typing engine: what a section declares, ``section_from``, the sizes' bounds;
* :mod:`.sections` — the sections every stage reads: ``data:``, ``train:``, ``distribute:``, ``decode:``;
* :mod:`.migrations` — a saved config's format versions and the migrations between them;
* :mod:`.addresses` — a server's ``HOST:PORT`` as a setting takes it.
"""

from captioning.config.loader import (COMPONENT_SECTIONS, ComponentSection, Config, ModelConfig, all_keys, from_dict,
                                      ineffective, load_config, save_config, save_record, to_dict, validate,
                                      with_absolute_paths)
from captioning.config.sections import DataConfig, DecodeConfig, DistributeConfig, TrainConfig

__all__ = ["COMPONENT_SECTIONS", "ComponentSection", "Config", "DataConfig", "DecodeConfig", "DistributeConfig",
           "ModelConfig", "TrainConfig", "all_keys", "from_dict", "ineffective", "load_config", "save_config", "save_record",
           "to_dict", "validate", "with_absolute_paths"]
