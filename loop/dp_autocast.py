"""AutocastForward: the run's autocast in each of nn.DataParallel's replica threads (train.py --parallel dp)."""
import torch


class AutocastForward(torch.nn.Module):
    """`module` whose forward runs under the run's autocast, for nn.DataParallel: it runs each replica in a thread of
    its own, and autocast state is per thread; torch's parallel_apply enters autocast there again without the dtype,
    which on CUDA means fp16, so a bf16 run would compute its replicas in fp16 with no GradScaler."""

    def __init__(self, module, device_type, dtype, enabled):
        super().__init__()
        self.module, self.device_type, self.dtype, self.enabled = module, device_type, dtype, enabled

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled):
            return self.module(*args, **kwargs)
