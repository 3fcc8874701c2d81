"""The layout's rules (utils/layout.py): every rule a tp x cp x dp layout and its memory switches must obey lives in
one object, and every place that used to check one (comm, the ViT, parallelize, the batch split, the planner) asks
it. Each rule is shown refusing a layout in one line, with its facts; the twin runs the same layout with that rule
taken out of RULES and shows nothing else refuses it (so the rule is what refuses, not another check).
A failure points to utils/layout.py, or to a caller that checks a rule of its own again.
"""

import pytest
import torch

from lifecycle.cli import apply_overrides, model_parallel_parser, training_parser
from planning import plan
from utils import comm, layout
from utils.errors import UserError
from utils.layout import RULES, Layout
from utils.YParams import YParams

# rule name: (layout settings, facts, words of the refusal, the place that checks it with these facts)
CASES = {
    "sizes_are_whole_numbers": ({"tp": 0}, {}, "tp is 0; give a whole number of ranks, at least 1", "layout"),
    "order_names_each_dimension": ({"order": "tp-ep"}, {}, "order 'tp-ep' names 'ep'", "layout"),
    "sequence_parallel_needs_tp": ({"sequence_parallel": True}, {}, "it needs --tensor_parallel 2 or more", "layout"),
    "cp_method_is_known": ({"cp_method": "ulysses"}, {}, "--cp_method 'ulysses' is not a context-parallel method",
                           "layout"),
    "grid_divides_world": ({"tp": 2, "cp": 2}, {"world_size": 6},
                           "tp x cp = 2 x 2 = 4 does not divide the world size 6", "comm"),
    "heads_split_over_tp": ({"tp": 4}, {"num_heads": 6}, "num_heads 6 does not divide by tp = 4", "vit"),
    "heads_split_over_cp_for_alltoall": ({"cp": 4, "cp_method": "alltoall"}, {"num_heads": 6},
                                         "--cp_method alltoall splits the heads over cp: num_heads / tp = 6 / 1 = 6 "
                                         "does not divide by cp = 4", "vit"),
    "mlp_width_splits_over_tp": ({"tp": 4}, {"mlp_hidden": 1022}, "the MLP hidden width 1022 does not divide",
                                 "vit"),
    "every_cp_rank_has_tokens": ({"cp": 8}, {"tokens": 4}, "the sequence has 4 patches, fewer than cp = 8", "vit"),
    "no_dropout_with_cp": ({"cp": 2}, {"dropout": 0.1}, "dropout 0.1 with context parallelism", "vit"),
    "no_dropout_with_sequence_parallel": ({"tp": 2, "sequence_parallel": True}, {"dropout": 0.1},
                                          "dropout 0.1 with --sequence_parallel", "vit"),
    "fsdp_replaces_ddp": ({"fsdp": True}, {"noddp": True}, "--fsdp replaces DDP", "parallelize"),
    "fsdp_shards_contiguous_weights": ({"fsdp": True}, {"channels_last": True}, "add --no-enable_nhwc",
                                       "parallelize"),
    "batch_splits_over_dp": ({"dp": 3}, {"global_batch": 8}, "cannot evenly distribute 8 across 3 GPU", "batch"),
    "pipeline_schedule_is_known": ({"pp": 2, "microbatches": 2, "pp_schedule": "zb"}, {},
                                   "--pp_schedule 'zb' is not a pipeline schedule", "layout"),
    "enough_microbatches_for_the_stages": ({"pp": 4, "microbatches": 2}, {},
                                           "--num_microbatches 2 is fewer than the 4 pipeline stages", "layout"),
    "stage_sizes_are_given_for_each_stage": ({"pp": 2, "microbatches": 2, "pp_layers": (2, 1, 1)}, {},
                                             "--pp_layers 2,1,1 gives 3 stage(s) for --pipeline_parallel 2", "layout"),
    "stages_hold_the_blocks": ({"pp": 4, "microbatches": 4}, {"depth": 2},
                               "--pipeline_parallel 4 is more stages than the model's 2 blocks", "vit"),
}


def test_every_rule_is_listed_here():
    """A rule added to utils/layout.py without a case here fails, as does a case for a rule that is gone."""
    assert sorted(check.__name__ for _, check in RULES) == sorted(CASES)


def _refused_by_the_object(settings, facts):
    """The refusal as Layout raises it: on construction for the rules that need no fact, by check() for the rest."""
    with pytest.raises(UserError) as refused:
        Layout(**settings).check(**facts)
    return str(refused.value)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rule_refuses_in_one_line(name):
    settings, facts, words, _ = CASES[name]
    line = _refused_by_the_object(settings, facts)
    assert words in line and "\n" not in line


@pytest.mark.parametrize("name", sorted(CASES))
def test_without_the_rule_the_layout_passes(name, monkeypatch):
    """The twin: the same layout and facts with this one rule removed raise nothing."""
    settings, facts, _, _ = CASES[name]
    monkeypatch.setattr(layout, "RULES", [(needs, check) for needs, check in RULES if check.__name__ != name])
    if name == "sizes_are_whole_numbers":  # the rank generator checks sizes too: taken out with it
        monkeypatch.setattr(Layout, "grid", lambda self: None)
    Layout(**settings).check(**facts)


def _vit_params(**changes):
    params = YParams("config/ViT.yaml", "tiny")
    params.update(changes)
    return params


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case[3] == "vit"])
def test_the_vit_asks_the_layout(name, monkeypatch):
    """The ViT refuses with the layout's line, and builds once the rule is removed (its own checks keep shapes)."""
    from networks.vit import ViT
    settings, facts, words, _ = CASES[name]
    changes = {"num_heads": {"num_heads": 6, "embed_dim": 48}, "mlp_hidden": {"mlp_ratio": 1022 / 32, "num_heads": 4},
               "tokens": {"img_size": [8, 8]}, "dropout": {"dropout": 0.1}, "depth": {"depth": 2}}[next(iter(facts))]
    with pytest.raises(UserError) as refused:
        ViT(_vit_params(**changes), Layout(**settings))
    assert words in str(refused.value)
    monkeypatch.setattr(layout, "RULES", [(needs, check) for needs, check in RULES if check.__name__ != name])
    ViT(_vit_params(**changes), Layout(**settings))  # this process has no groups: the model builds whole


def test_comm_parallelize_and_the_batch_split_ask_the_layout(monkeypatch):
    """comm.init refuses a grid that does not divide the world, parallelize what FSDP cannot combine with, the batch
    split a batch that does not divide over dp: each the layout's line."""
    from distributed.data_parallel import DDPOptions
    from distributed.parallelize import Options, parallelize
    from utils.layout import Grid
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(UserError, match=CASES["grid_divides_world"][2]):
        comm.init({"tp": 2, "cp": 2})
    with pytest.raises(UserError, match=CASES["fsdp_replaces_ddp"][2]):
        parallelize(torch.nn.Linear(2, 2), Grid(Layout(fsdp=True)), torch.device("cpu"),
                    Options(ddp=DDPOptions(enabled=False)))
    params = YParams("config/ViT.yaml", "tiny")
    params.update({"global_batch_size": 8})
    with pytest.raises(UserError, match=CASES["batch_splits_over_dp"][2]):
        apply_overrides(params, training_parser("t").parse_args([]), dp_size=3, dp_rank=0)


def test_the_planner_refuses_with_the_same_lines():
    """planning/plan.py checks a layout with the same object: its refusal is the training script's line."""
    shape = plan.ViTShape.from_params(YParams("config/ViT.yaml", "mp"))  # 8 heads, 4050 tokens, global batch 64
    assert plan.refusal(shape, Layout(tp=16), 64) == Layout(tp=16).refusal(num_heads=8)
    assert "cannot evenly distribute 64 across 128 GPU" in plan.refusal(shape, Layout(dp=128), 64)
    assert plan.refusal(shape, Layout(tp=4, dp=4), 64) is None


def test_a_layout_is_built_from_the_flags_and_the_world():
    """dp is what is left of the world; the order as given; the switches from their flags."""
    args = model_parallel_parser("t").parse_args(["--tensor_parallel", "2", "--context_parallel", "2",
                                                  "--parallel_order", "cp-tp-dp", "--sequence_parallel", "--fsdp"])
    built = Layout.from_flags(args, 8)
    assert built == Layout(tp=2, cp=2, dp=2, order="cp-tp-dp", sequence_parallel=True, fsdp=True)
    assert built.world_size == 8 and built.model_parallel == 4
    assert built.flags() == ["--tensor_parallel=2", "--context_parallel=2", "--parallel_order=cp-tp-dp",
                             "--sequence_parallel", "--fsdp"]
    assert Layout.from_dict({"tp": 2}, 4) == Layout(tp=2, dp=2)


def refusals_outside_the_layout(root, rule_lines):
    """'file: words' for each project .py file outside utils/layout.py and tests/ that holds the words of a rule's
    refusal (the first 40 characters): a second copy of a rule."""
    import os
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name not in ("tests", "data")]
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), root)
            if not name.endswith(".py") or path == os.path.join("utils", "layout.py"):
                continue
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                text = f.read()
            found += [f"{path}: {line[:40]}" for line in rule_lines if line[:40] in text]
    return found


def test_no_caller_keeps_a_copy_of_a_rule(tmp_path):
    """Each rule's refusal is written once, in utils/layout.py; the twin: a module holding a copy of one is found."""
    from tests.conftest import REPO_ROOT
    lines = [_refused_by_the_object(settings, facts) for settings, facts, _, _ in CASES.values()]
    assert refusals_outside_the_layout(REPO_ROOT, lines) == []
    (tmp_path / "plan.py").write_text(f"def check():\n    return {lines[4]!r}\n")
    assert refusals_outside_the_layout(str(tmp_path), lines) == [f"plan.py: {lines[4][:40]}"]


def test_a_pipeline_layout_from_the_flags():
    """--pipeline_parallel and its flags: dp is what tp x cp x pp leave; M defaults to P; pp is the slowest
    dimension unless the order names it; the local batch must split into the microbatches (the batch rule's second
    half, refused in one line; the twin: a batch that splits passes)."""
    args = model_parallel_parser("t").parse_args(["--tensor_parallel", "2", "--pipeline_parallel", "2",
                                                  "--pp_schedule", "gpipe", "--pp_layers", "1,3"])
    built = Layout.from_flags(args, 8)
    assert built == Layout(tp=2, dp=2, pp=2, microbatches=2, pp_schedule="gpipe", pp_layers=(1, 3))
    assert built.grid().get_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]] and built.name == "2MP2PP"
    assert built.flags()[-3:] == ["--num_microbatches=2", "--pp_schedule=gpipe", "--pp_layers=1,3"]
    assert Layout(pp=2, microbatches=2, order="pp-tp-cp-dp").grid().get_ranks("pp") == [[0, 1]]
    with pytest.raises(UserError, match="the local batch 6 .* does not split into --num_microbatches 4 equal"):
        Layout(dp=2, pp=4, microbatches=4).check(global_batch=12)
    Layout(dp=2, pp=4, microbatches=4).check(global_batch=16)
    with pytest.raises(UserError, match="--pp_layers 'a,b' is not a list of block counts"):
        Layout.from_flags(model_parallel_parser("t").parse_args(["--pipeline_parallel", "2", "--pp_layers", "a,b"]), 2)
