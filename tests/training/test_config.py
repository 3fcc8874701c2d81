"""Config loading and flag overrides. A failure points to utils/YParams.py or lifecycle/cli.py."""
import copy
import os
import pickle

import pytest
import torch

from lifecycle.cli import apply_overrides, reroot, training_parser
from utils.errors import UserError
from utils.YParams import YParams

VIT_YAML = "config/ViT.yaml"
ORIGINAL_CONFIGS = ["base", "short", "short_opt", "opt", "bs16_opt", "bs32_opt", "bs64_opt", "bs128_opt",
                    "bs256_opt", "bs512_opt", "bs1024_opt", "bs2048_opt", "mp", "mp_bs16", "mp_bs32", "mp_patch4"]
SC25_CONFIGS = {"bs64_opt_short": "bs64_opt", "mp_short": "mp"}  # sc25's profiling configs and what each cuts short


pytestmark = pytest.mark.usefixtures("in_repo_root")


@pytest.mark.parametrize("name", ORIGINAL_CONFIGS + list(SC25_CONFIGS) + ["short_h64", "demo", "tiny"])
def test_every_config_loads(name):
    params = YParams(VIT_YAML, name)
    assert params.n_in_channels == 20 and params.lr > 0


def test_inheritance_through_anchors_and_merge_keys():
    base, short, short_opt = (YParams(VIT_YAML, n) for n in ("base", "short", "short_opt"))
    assert (short.limit_nsamples, short.limit_nsamples_val, short.num_iters) == (512, 128, 128)
    assert short.embed_dim == base.embed_dim == 384 and short.lr == 5e-4
    assert short_opt.limit_nsamples == 512  # two levels down
    assert (short_opt.data_loader_config, short_opt.amp_mode, short_opt.enable_fused) == ("dali", "fp16", True)
    assert base.limit_nsamples is None  # the YAML word None
    bs = {n: (YParams(VIT_YAML, n).global_batch_size, YParams(VIT_YAML, n).lr)
          for n in ("bs64_opt", "bs1024_opt", "bs2048_opt")}
    assert bs == {"bs64_opt": (64, 1e-3), "bs1024_opt": (1024, 4e-3), "bs2048_opt": (2048, 5.66e-3)}
    mp, patch4 = YParams(VIT_YAML, "mp"), YParams(VIT_YAML, "mp_patch4")
    assert (mp.embed_dim, mp.global_batch_size, patch4.patch_size, patch4.embed_dim) == (1024, 64, 4, 1024)


@pytest.mark.parametrize("name, parent", SC25_CONFIGS.items())
def test_sc25_short_configs_are_their_parent_on_2048_samples_for_128_iterations(name, parent):
    short, full = YParams(VIT_YAML, name).params, YParams(VIT_YAML, parent).params
    changed = {key: short[key] for key in short if short[key] != full.get(key)}
    assert changed == {"limit_nsamples": 2048, "limit_nsamples_val": 2048, "num_iters": 128}


def test_short_h64_is_short_with_6_heads_of_64_and_the_same_parameter_shapes():
    """`short_h64` changes only the number of heads (384 channels: 6 of 64 instead of 8 of 48), so its weights have
    `short`'s names and shapes: a different model that nothing in a checkpoint tells apart (docs/answers.md)."""
    from networks import get_model
    h64, short = YParams(VIT_YAML, "short_h64"), YParams(VIT_YAML, "short")
    assert {key: h64.params[key] for key in h64.params if h64.params[key] != short.params.get(key)} == {"num_heads": 6}
    assert h64.embed_dim // h64.num_heads == 64 and short.embed_dim // short.num_heads == 48
    with torch.device("meta"):
        shapes = [{k: v.shape for k, v in get_model(p).state_dict().items()} for p in (h64, short)]
    assert shapes[0] == shapes[1]


def overridden(config, flags, dp_size=1):
    params = YParams(VIT_YAML, config)
    apply_overrides(params, training_parser("t").parse_args(flags), dp_size=dp_size, dp_rank=0)
    return params


def test_flags_switch_yaml_values_both_ways():
    params = overridden("short_opt", ["--no-enable_fused", "--no-enable_jit", "--amp_mode", "none",
                                      "--data_loader_config", "pytorch", "--num_data_workers", "0"])
    assert (params.enable_fused, params.enable_jit, params.amp_enabled) == (False, False, False)
    assert (params.data_loader_config, params.num_data_workers) == ("pytorch", 0)
    params = overridden("short", ["--enable_fused", "--amp_mode", "bf16", "--num_iters", "7"])
    assert params.enable_fused and params.amp_dtype == torch.bfloat16 and params.num_iters == 7
    params = overridden("short", [])  # no flag: YAML values stay
    assert (params.enable_fused, params.amp_mode, params.num_iters) == (False, "none", 128)


def test_batch_split_over_data_parallel_ranks():
    params = overridden("bs64_opt", [], dp_size=4)
    assert (params.global_batch_size, params.local_batch_size) == (64, 16)
    params = overridden("bs64_opt", ["--local_batch_size", "8"], dp_size=4)
    assert (params.global_batch_size, params.local_batch_size) == (32, 8)
    # one "error" (`error: cannot evenly ...`); before, `error: Error, cannot evenly distribute ... GPU. Choose ...`
    with pytest.raises(UserError, match=r"^cannot evenly distribute 64 across 3 GPU: choose a global_batch_size"):
        overridden("bs64_opt", [], dp_size=3)


def test_data_dir_reroots_only_data_paths():
    params = overridden("short", ["--data_dir", "/tmp/sample"])
    assert params.train_data_path == "/tmp/sample/train"
    assert params.global_stds_path == "/tmp/sample/stats/global_stds.npy"
    assert reroot("/elsewhere/x", "/data", "/tmp/sample") == "/elsewhere/x"
    assert reroot("/database/x", "/data", "/tmp/sample") == "/database/x"  # prefix must be a whole folder
    assert overridden("short", ["--data_dir", ""]).train_data_path == "/data/train"


def test_unknown_config_lists_the_names():
    with pytest.raises(UserError, match="config 'nope' is not in .*choose one of: base, short"):
        YParams(VIT_YAML, "nope")


def test_a_missing_yaml_file_is_one_line():
    with pytest.raises(UserError, match="'config/missing.yaml' not found"):
        YParams("config/missing.yaml", "base")


def test_a_key_the_config_lacks_names_the_key_the_config_and_the_file():
    """params.key or params["key"] of a key the config lacks: a UserError (one line, exit 2 in a script) naming the key,
    the config and the file, and where the repository's configs set it; before, a bare AttributeError (KeyError), a
    traceback and exit 1. And it is still an AttributeError and a KeyError, so getattr with a default, hasattr,
    `except KeyError`, pickling (a loader worker's copy) and deepcopy behave as before."""
    params = YParams(VIT_YAML, "tiny")
    said = (r"^config 'tiny' in config/ViT\.yaml has no key 'nope', which this run reads; add `nope: \.\.\.` to it$")
    with pytest.raises(UserError, match=said):
        params.nope  # noqa: B018 (the read is the test)
    with pytest.raises(UserError, match=said):
        params["nope"]
    del params.params["depth"]
    with pytest.raises(UserError, match=r"has no key 'depth', .*; config/ViT\.yaml's tiny sets it: 2$"):
        params.depth  # noqa: B018
    assert getattr(params, "nope", 7) == 7 and not hasattr(params, "nope") and "nope" not in params
    with pytest.raises(KeyError):
        params["nope"]
    for copied in (pickle.loads(pickle.dumps(params)), copy.deepcopy(params)):
        assert copied.params == params.params and copied.embed_dim == 32 and copied.config_name == "tiny"


def test_stages_whose_configs_share_a_name_write_to_different_run_directories():
    """The ViT's, the UNet's and the ResNet's YAML files share config names (short, base, demo, tiny, ...): with their
    own defaults no two stages' runs of one name land in the same <expdir>/<config>/ folder (issue #40). The ViT keeps
    the original's /logs; the others add their model's folder."""
    import glob

    import yaml
    by_name = {}
    for path in sorted(glob.glob("config/*.yaml")):
        for name in yaml.safe_load(open(path)):
            by_name.setdefault(name, []).append(os.path.join(YParams(path, name).expdir, name))
    shared = {name: dirs for name, dirs in by_name.items() if len(dirs) > 1}
    assert {"base", "short", "demo", "tiny"} <= set(shared)
    assert all(len(set(dirs)) == len(dirs) for dirs in shared.values()), shared
    assert YParams("config/ViT.yaml", "base").expdir == "/logs"


def test_a_run_directory_of_another_model_is_refused_in_one_line(tmp_path):
    """A UNet run in a directory a ViT run used (both told the same --expdir) is refused, naming both models and a
    folder of its own; a run of the same model goes on there (the twin: the refusal is the model's, not the
    directory's)."""
    from lifecycle.run_lock import RunDirectoryLock
    run_dir = tmp_path / "short" / "1GPU" / "00"
    run_dir.mkdir(parents=True)
    RunDirectoryLock(str(run_dir), "vit").release()
    with pytest.raises(UserError, match=rf"^run directory '{run_dir}' holds a run of the vit model, not the unet: .*"
                                        rf"\(e.g. --expdir {tmp_path / 'unet'}\) or another --run_num$"):
        RunDirectoryLock(str(run_dir), "unet")
    RunDirectoryLock(str(run_dir), "vit").release()
    assert open(run_dir / "run.lock").read().splitlines()[1] == "model: vit"
