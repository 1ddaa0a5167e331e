"""The data sources (``data.features``): a registry whose entries the stages ask, never a branch on the name.

A toy source written in a temporary folder is registered with one entry and every stage that differs by what a
model reads asks it: the model (its encoder pooled or not, trained or not, its tokens' layout and places, the
pass that creates its variables), the ensemble's one input, the captioner's inputs (boxes), the LiteRT and
server refusals. tests/test_architecture.py checks that no module outside ``captioning/model/data_sources/``
tests a source's name; tests/test_region_training.py and tests/test_regions.py run the ``regions`` source."""

import importlib.util

import numpy as np
import pytest

from captioning.config import Config, ModelConfig, load_config
from captioning.errors import InputError
from captioning.model import build_model
from captioning.model.data_sources import DATA_SOURCES, Images, Regions, data_source
from captioning.model.folder import TrainedModel
from captioning.vocab import Vocabulary

TOY = '''
"""A toy data source that is not part of the project: the images' pixels, with the encoder kept as tokens, frozen,
and its tokens a set without layout or places; refused by LiteRT and the server."""

from captioning.errors import InputError
from captioning.model.data_sources.images import Images


class Toy(Images):
    name = "toy"
    encoder_trains = False
    tokens_have_places = False
    litert_refusal = "the toy source has no LiteRT file"
    serve_refusal = "the toy source is not served"

    def check(self):
        if self.config.data.image_size != 32:
            raise InputError("data.features: toy reads 32 px images")

    def encoder_pooled(self, decoder_class):
        return False

    def token_layout(self, encoder):
        return None

    def evaluation_input(self):
        return {**super().evaluation_input(), "toy": True}
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy source's class, registered as ``data.features: toy`` for the test (one entry)."""
    path = tmp_path / "toy_source.py"
    path.write_text(TOY)
    spec = importlib.util.spec_from_file_location("toy_source", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(DATA_SOURCES, "toy", module.Toy)
    return module.Toy


def _trained(model, cfg, path):
    return TrainedModel(model, cfg, Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "a"]), 0, "", str(path))


def test_the_registry_makes_the_chosen_source_and_refuses_an_unknown_one():
    assert type(data_source(load_config())) is Images
    regions = data_source(load_config(overrides=["data.features=regions", "data.features_store=oracle"]))
    assert type(regions) is Regions and regions.evaluation_input() == {"features": "regions",
                                                                       "features_store": "oracle"}
    from captioning import experiment

    for make in (lambda: data_source(load_config(overrides=["data.features=region"])),
                 lambda: experiment.load(overrides=["data.features=region"])):  # as the config is typed
        with pytest.raises(InputError, match="data.features must be one of images, regions, got 'region'.*regions"):
            make()
    for source, check in ((Images, "model.box_geometry=true"), (Images, "model.region_feature_size=8"),
                          (Regions, "data.cache=disk")):
        features = "regions" if source is Regions else "images"
        with pytest.raises(InputError) as refused:
            data_source(load_config(overrides=[f"data.features={features}", check])).check()
        assert "\n" not in str(refused.value)


def test_a_toy_source_is_one_file_and_one_entry_and_every_stage_asks_it(toy, tmp_path):
    from captioning.inference.captioner import Captioner
    from captioning.inference.litert import refusal
    from captioning.inference.serve import start
    from captioning.model.ensemble import check_same_input

    cfg = load_config(overrides=["data.features=toy", "data.image_size=32", "data.resize_size=36",
                                 "model.decoder=transformer", "model.encoder=small_cnn", "model.d_model=16",
                                 "model.heads=2", "model.ff_size=24", "model.encoder_layers=1",
                                 "model.decoder_layers=1"])
    source = data_source(cfg)
    assert type(source) is toy and source.config is cfg
    source.check()
    with pytest.raises(InputError, match="toy reads 32 px images"):
        data_source(load_config(overrides=["data.features=toy"])).check()
    model = build_model(5, cfg.model, 32, source=source).build_all()
    assert model.source is source and model.cell_positions is None and model.token_layout is None
    assert not model.encoder.trainable and model.grid_cells == model.image_encoder.tokens > 1  # kept as tokens
    plain = build_model(5, cfg.model, 32).build_all()  # the default source: the images
    assert type(plain.source) is Images and plain.cell_positions is not None and plain.encoder.trainable

    trained = _trained(model, cfg, tmp_path / "toy")
    images = _trained(plain, load_config(overrides=["data.image_size=32", "data.resize_size=36"]), tmp_path / "plain")
    captioner = Captioner(trained)
    assert not captioner.takes_boxes and captioner.token_layout is None
    assert refusal(captioner) == "the toy source has no LiteRT file" and refusal(Captioner(images)) is None
    with pytest.raises(InputError, match="^the toy source is not served$"):
        start(captioner)
    with pytest.raises(InputError, match="read different inputs .*data.toy True against None"):
        check_same_input([trained, images])
    captions = captioner.caption([_jpeg()])  # new images from their pixels alone, as its source says
    assert len(captions) == 1 and captions[0][0].boxes is None


def _jpeg() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((40, 48, 3), 120, np.uint8)).save(buffer, format="JPEG")
    return buffer.getvalue()


def test_the_regions_source_gives_the_model_its_depth_and_a_frozen_encoder_of_tokens():
    """A regions model's decoder reads ``model.region_feature_size`` features a region plus its box
    (``model.box_geometry``: 5), over no layout; its encoder keeps its tokens (a pooled decoder's too) and is
    frozen."""
    cfg = Config()
    cfg.data.features = "regions"
    cfg.model = ModelConfig(decoder="show_and_tell", encoder="small_cnn", region_feature_size=8, box_geometry=True,
                            options={"lstm_units": 8, "embedding_size": 8})
    model = build_model(5, cfg.model, 32, source=data_source(cfg)).build_all()
    assert model.feature_size == 8 + 5 and model.token_layout is None and not model.encoder.trainable
    assert model.image_encoder.tokens > 1  # not pooled: new images' regions are pooled from its tokens
    assert model.source.takes_boxes and model.source.litert_refusal and model.source.serve_refusal
