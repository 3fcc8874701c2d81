"""The ViT fed a cp rank's band of image rows (distributed/bands.py) against the serial ViT, on 4 spawned gloo ranks.

wfm_tiny's shape (24 x 48 images, patch 2: 12 x 24 = 288 tokens), depth 2, at cp=4 (72 tokens a rank: bands of 3
patch rows), and a 26 x 48 image (13 x 24 = 312 tokens, 78 a rank: every band but the first starts inside a row of
patches and shares it with the rank before). Each rank feeds the model its band only, and gets:
- the whole target back from its band (Band.whole: each rank's own patches all-gathered over cp), bitwise;
- the serial model's output (the whole field: the sequence is gathered before the head) within 1e-5;
- the serial gradients of the patch and position embeddings (which see only the band: summed over cp by the marked
  reduction of data_parallel.py) and of the rest, within 1e-5;
- the same output when fed the whole field (the model cuts its band out itself).
Twins that must fail: targets gathered with the ranks in the wrong order; the embeddings' gradients left unsummed.
A failure points to distributed/bands.py, networks/vit.py's forward or parallelize.split_tokens_and_weights' marks.
"""
import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import as_spawned_rank, free_port

pytestmark = pytest.mark.multiprocess
TOLERANCE = 1e-5
# wfm_tiny's image: 12 rows of 24 patches, 72 tokens a rank (3 whole rows); and one of 13 rows: 78 tokens a rank,
# so bands start and end inside a row of patches (the tutorial's mp at cp=4: 1,013 tokens over rows of 90)
IMAGES = [(24, 48), (26, 48)]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _compare(rank, world, port, results):
    as_spawned_rank(rank, world, port)
    import torch.distributed as dist

    from utils import comm
    torch.set_num_threads(1)
    comm.init({"cp": world}, rendezvous_timeout=60)
    found = {}
    for img_size in IMAGES:
        found.update({f"{img_size}: {label}": error for label, error in _compare_at(img_size, world).items()})
        dist.barrier()
    results[rank] = found
    comm.destroy()


def _compare_at(img_size, world):
    from distributed.bands import Band
    from distributed.data_parallel import DDPOptions, reduce_marked_gradients
    from distributed.parallelize import Options, parallelize
    from networks.vit import VisionTransformer
    from utils import comm
    from utils.layout import Axis
    grid = comm.init({"cp": world}, rendezvous_timeout=60)
    torch.manual_seed(0)
    inp, tar = torch.randn(2, 20, *img_size), torch.randn(2, 20, *img_size)

    def build():
        torch.manual_seed(1)
        return VisionTransformer(img_size, 2, 20, 20, 64, 2, 8)

    serial = build()
    out = serial(inp)
    ((out - tar) ** 2).mean().backward()
    model = parallelize(build(), grid, torch.device("cpu"), Options(ddp=DDPOptions(enabled=False)))
    band = Band.of(img_size, 2, grid["cp"])
    y0, y1 = band.rows
    errors = {"whole target": (band.whole(tar[:, :, y0:y1]) != tar).sum().item()}
    reversed_band = Band.of(img_size, 2, Axis("cp", world, world - 1 - grid["cp"].rank, grid["cp"].group))
    r0, r1 = reversed_band.rows
    errors["twin: ranks in the wrong order"] = (reversed_band.whole(tar[:, :, r0:r1]) != tar).sum().item()
    got = model(inp[:, :, y0:y1])
    errors["output"] = rel(got, out)
    errors["output of the whole field"] = rel(model(inp), got)
    ((got - tar) ** 2).mean().backward()
    params = [p for p in model.parameters() if p.grad is not None]
    unsummed = {name: p.grad.clone() for name, p in model.named_parameters() if name in ("pos_embed",
                                                                                          "patch_embed.proj.weight")}
    reduce_marked_gradients(grid, params, [p.grad for p in params])
    serial_grads = dict(serial.named_parameters())
    for name in ("pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias", "head.weight", "norm.weight"):
        errors[f"grad {name}"] = rel(dict(model.named_parameters())[name].grad, serial_grads[name].grad)
    for name, grad in unsummed.items():
        errors[f"twin: grad {name} unsummed"] = rel(grad, serial_grads[name].grad)
    return errors


def test_a_band_fed_model_is_the_serial_model_and_its_twins_are_not():
    results = mp.Manager().dict()
    mp.spawn(_compare, args=(4, free_port(), results), nprocs=4)
    results = dict(results)
    assert len(results) == 4 and all(len(errors) == 2 * 11 for errors in results.values()), results
    for rank, errors in results.items():
        for label, error in errors.items():
            if ": twin" in label:
                assert error > (0 if "order" in label else 0.1), (rank, label, error)
            elif label.endswith("whole target"):
                assert error == 0, (rank, label, error)
            else:
                assert error <= TOLERANCE, (rank, label, error)
