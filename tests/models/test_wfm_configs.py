"""The weather-foundation-model configs of config/ViT.yaml (`wfm_*`): ERA5's 0.25-degree grid and `wfm_tiny`.

Every model is built on the meta device only (shapes, no memory: `wfm_10b_p2`'s fp32 weights alone would be 43 GB),
and its parameters and tokens are the numbers docs/flags.md and the YAML's comment give. A failure points to a
changed config, to networks/vit.py (a layer added or resized), or to docs that no longer say the config's numbers.
"""
import re

import pytest
import torch

from networks import get_model
from utils.layout import Layout
from utils.YParams import YParams

pytestmark = pytest.mark.usefixtures("in_repo_root")
VIT_YAML = "config/ViT.yaml"
# name -> (img_size, patch, embed, depth, heads, parameters, tokens)
WFM = {
    "wfm_p8": ([720, 1440], 8, 1024, 12, 16, 170_368_000, 16_200),
    "wfm_p4": ([720, 1440], 4, 1024, 12, 16, 218_168_320, 64_800),
    "wfm_p2": ([720, 1440], 2, 1024, 12, 16, 416_742_400, 259_200),
    "wfm_1b_p4": ([720, 1440], 4, 2048, 18, 16, 1_040_476_160, 64_800),
    "wfm_10b_p2": ([720, 1440], 2, 4096, 48, 32, 10_728_583_168, 259_200),
    "wfm_tiny": ([24, 48], 2, 64, 4, 8, 228_800, 288),
}


def meta_model(name):
    """The config's serial ViT on the meta device: every parameter's shape, no storage."""
    with torch.device("meta"):
        return get_model(YParams(VIT_YAML, name))


def expected_parameters(img_size, patch, embed, depth, channels=20, mlp_ratio=4):
    """The ViT's parameters from its shape: per block q, k, v, proj (4 E^2 + 4 E), the MLP (2 r E^2 + r E + E) and two
    LayerNorms (4 E); the patch embedding (C p^2 E + E), the position embedding (tokens x E), the final norm (2 E) and
    the head (E x C p^2, no bias)."""
    tokens = (img_size[0] // patch) * (img_size[1] // patch)
    block = 4 * embed * embed + 4 * embed + 2 * mlp_ratio * embed * embed + mlp_ratio * embed + embed + 4 * embed
    patch_values = channels * patch ** 2
    return depth * block + (patch_values * embed + embed) + tokens * embed + 2 * embed + embed * patch_values


@pytest.mark.parametrize("name", WFM)
def test_parameters_and_tokens_of_each_config(name):
    """Summed on the meta-device model, against the table and against the count from the shape; the twin: the
    count without the position embedding misses (at patch 2 that embedding is a tenth to a half of the model)."""
    img_size, patch, embed, depth, heads, parameters, tokens = WFM[name]
    params = YParams(VIT_YAML, name)
    assert (list(params.img_size), params.patch_size, params.embed_dim, params.depth, params.num_heads) == \
        (img_size, patch, embed, depth, heads)
    model = meta_model(name)
    assert all(p.is_meta for p in model.parameters())
    counted = sum(p.numel() for p in model.parameters())
    assert counted == parameters == expected_parameters(img_size, patch, embed, depth)
    assert model.h * model.w == tokens == model.layout_facts()["tokens"]
    assert counted - tokens * embed != parameters


@pytest.mark.parametrize("name", [name for name in WFM if name != "wfm_tiny"])
def test_the_quarter_degree_configs_read_720_of_721_rows_with_heads_of_64_or_128(name):
    params = YParams(VIT_YAML, name)
    assert list(params.img_size) == [720, 1440] and params.embed_dim // params.num_heads in (64, 128)
    assert params.embed_dim % params.num_heads == 0 and params.data_loader_config == "pytorch"


def test_the_1b_and_10b_models_are_about_their_names():
    assert 0.95e9 < WFM["wfm_1b_p4"][5] < 1.15e9
    assert 9.5e9 < WFM["wfm_10b_p2"][5] < 11e9


def test_the_patch_configs_are_one_model_at_three_patch_sizes():
    """wfm_p4 and wfm_p2 are wfm_p8 with another patch (inherited through the YAML anchor); 4x the tokens a step."""
    p8 = YParams(VIT_YAML, "wfm_p8").params
    for name, patch in (("wfm_p4", 4), ("wfm_p2", 2)):
        other = YParams(VIT_YAML, name).params
        assert {key: other[key] for key in other if other[key] != p8.get(key)} == {"patch_size": patch}
    assert WFM["wfm_p4"][6] == 4 * WFM["wfm_p8"][6] and WFM["wfm_p2"][6] == 4 * WFM["wfm_p4"][6]


@pytest.mark.parametrize("tp, cp, pp", [(1, 4, 1), (1, 1, 4), (2, 2, 1), (4, 1, 1), (1, 2, 2)])
def test_wfm_tiny_splits_over_cp_4_pp_4_and_tp_2_x_cp_2(tp, cp, pp):
    """The layout's rules with wfm_tiny's facts (heads over tp, tokens over cp, no dropout), whole heads for an
    all-to-all cp over the heads left after tp, whole blocks for pp stages, and tokens that split evenly over cp."""
    params = YParams(VIT_YAML, "wfm_tiny")
    facts = meta_model("wfm_tiny").layout_facts()
    assert Layout(tp=tp, cp=cp).refusal(**facts) is None
    assert facts["dropout"] == 0 and params.dropout == 0
    assert facts["num_heads"] % (tp * cp) == 0 and params.depth % pp == 0 and facts["tokens"] % cp == 0
    assert Layout(tp=3).refusal(**facts) is not None  # the twin: 8 heads do not split over 3


def test_wfm_tiny_is_the_quarter_degree_grid_in_small_on_a_cpu():
    """The 2:1 grid at a few hundred tokens, cut from files one row taller (as 720 x 1440 from 721 x 1440), in fp32
    with plain Adam, small enough for a CPU (under a million parameters)."""
    params = YParams(VIT_YAML, "wfm_tiny")
    height, width = params.img_size
    assert width == 2 * height and 100 <= WFM["wfm_tiny"][6] <= 600
    assert params.amp_mode == "none" and not params.enable_fused and WFM["wfm_tiny"][5] < 1e6


def test_flags_md_and_the_yaml_say_each_configs_parameters_and_tokens():
    """docs/flags.md's row of each config and the YAML's comment give the counts measured above."""
    flags = open("docs/flags.md").read()
    yaml_text = open(VIT_YAML).read()
    for name, (*_, parameters, tokens) in WFM.items():
        row = re.search(rf"^\| [^|]*`{name}`[^|]*\|(.*)\|$", flags, re.MULTILINE)
        assert row, name
        assert f"{parameters:,}" in row.group(1) and f"{tokens:,}" in row.group(1), name
        comment = " ".join(yaml_text.replace("#", " ").split())
        said = re.search(rf"{name} ([0-9][0-9,]*[0-9]) at ([0-9][0-9,]*[0-9])", comment)
        assert said and said.group(1) == f"{parameters:,}" and said.group(2) == f"{tokens:,}", name
