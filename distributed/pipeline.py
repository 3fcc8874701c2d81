"""Pipeline parallelism (pp): the ViT's blocks split into P stages, one a rank of the "pp" group, and each step's
local batch cut into M microbatches that flow through them.

    stage 0: patch embedding + blocks 0..a-1   ->   stage 1: blocks a..b-1   ->   ...   ->   stage P-1: blocks ..
             + final norm, head and loss

A stage sends its output tokens to the next stage and receives, in the backward pass, the gradient of that output
(point-to-point send/recv over "pp": gloo on CPUs, NCCL on GPUs). Two schedules order the work, each one function:
- gpipe: every microbatch's forward, then every backward. Simple; a stage holds the activations of all M.
- one_f_one_b (1F1B): stage s runs P - s - 1 forwards to fill the pipe (warm-up), then alternates one forward and
  one backward (steady state), then drains the backwards left (cool-down). The same idle time as GPipe,
  (P - 1) / (M + P - 1) of a step, but stage 0 holds at most P microbatches' activations instead of M.
The loss of each microbatch is divided by M, so the gradients summed over the microbatches are the serial step's
over the whole batch (whose loss is the mean over equally many samples a microbatch). The last stage's loss is sent
to every stage (rank 0, which logs, holds stage 0), and the fp16 scaler's skip is agreed over "tp-cp-pp"
(train_mp.py), so every stage skips a step together.

Stages are cut by cost (balanced_layers): each block costs its forward and backward FLOPs; the first stage also
carries the patch embedding's, the last the head's (planning/perf_model.py's counts); the cut is the one whose most
loaded stage carries the least. `--pp_layers 5,6,6,7` gives the blocks per stage instead.

Under pipeline parallelism the stages are not wrapped in DDP: a step runs several backward passes, and the
gradients are reduced over "dp" once, after the last one (reduce_gradients), with the sums over cp and tp of the
marked ones; FSDP reduces its gradient shards in each backward itself. Checkpoints gather the serial model from the
stages (distributed/serial_state.py), so a run saved at pp = 4 resumes at pp = 2, at pp = 1 and in train.py.
"""
import collections
import logging

import torch
import torch.distributed as dist
import torch.nn as nn

from distributed.data_parallel import all_reduce_in_place, reduce_marked_gradients

# the twins (tests switch them): 1F1B one warm-up step short (a stage then waits for a microbatch that never comes,
# and the collective timeout ends the job in one line); the loss not divided by M; a backward fed the gradient of
# the wrong microbatch
WARMUP_OFFSET = 0
DIVIDE_LOSS = True
BACKWARD_IN_ORDER = True


class NotOnThisStage(nn.Identity):
    """The place of a block another stage holds: the block list keeps its length, so the blocks this stage holds
    keep their serial names (blocks.5.attn.q.weight) and checkpoints stay the serial model's."""


def balanced_layers(depth, stages, embed_cost=0.0, head_cost=0.0):
    """Blocks per stage: the contiguous cut of `depth` blocks (each of cost 1) into `stages`, the first carrying
    `embed_cost` more and the last `head_cost` more (in blocks), whose most loaded stage carries the least; among
    such cuts the most even one (the least sum of squared stage costs), then the one with fewer blocks early."""
    best = {}  # (first block, stages left) -> ((max cost, sum of squared costs), counts)

    def cut(first, left):
        if left == 1:
            cost = depth - first + head_cost + (embed_cost if first == 0 else 0.0)
            return (cost, cost * cost), (depth - first,)
        if (first, left) not in best:
            options = []
            for take in range(1, depth - first - left + 2):
                cost = take + (embed_cost if first == 0 else 0.0)
                (rest_max, rest_squares), rest = cut(first + take, left - 1)
                options.append(((max(cost, rest_max), cost * cost + rest_squares), take, (take,) + rest))
            key, _, counts = min(options, key=lambda option: (round(option[0][0], 9), round(option[0][1], 9),
                                                               option[1]))
            best[(first, left)] = (key, counts)
        return best[(first, left)]

    return cut(0, stages)[1]


def cost_ratios(embed_dim, tokens, hidden, in_channels, out_channels, patch_size):
    """(embedding, head) cost in blocks: their forward and backward FLOPs over one block's, counted as the planner
    counts them (planning/perf_model.py: flops_per_sample, block_flops_per_sample; every token, bidirectional
    attention). The planner's stage_cost_ratios calls this with a config's shape, stage_costs with a model's."""
    d, t, patch = embed_dim, tokens, patch_size ** 2
    block = 3 * (2 * t * (4 * d * d + 2 * d * hidden) + 4 * t * t * d)
    embed = 2 * (2 * t * d * in_channels * patch)
    head = 3 * (2 * t * d * out_channels * patch)
    return embed / block, head / block


def stage_costs(model):
    """cost_ratios of the serial ViT `model`."""
    return cost_ratios(model.embed_dim, model.h * model.w, model.held_blocks()[0].mlp.fc1.out_features,
                       model.patch_embed.proj.in_channels, model.out_chans, model.patch_size)


def keep_stage(model, layout, pp):
    """Cut the serial ViT down, in place, to this rank's stage: its blocks (the others NotOnThisStage), the patch and
    position embeddings on the first stage only, the final norm and head on the last only. Returns the blocks per
    stage."""
    model.serial_parameter_names = [name for name, _ in model.named_parameters()]  # checkpoints number them so
    depth = len(model.blocks)
    layers = layout.pp_layers or balanced_layers(depth, layout.pp, *stage_costs(model))
    start = sum(layers[:pp.rank])
    held = range(start, start + layers[pp.rank])
    for index in range(depth):
        if index not in held:
            model.blocks[index] = NotOnThisStage()
    model.first_stage, model.last_stage = pp.rank == 0, pp.rank == layout.pp - 1
    if not model.first_stage:
        model.patch_embed, model.pos_embed = None, None
    if not model.last_stage:
        model.norm, model.head = None, None
    model.pp, model.stage_blocks = pp, held
    logging.info(f"pipeline stage {pp.rank} of {layout.pp}: blocks {held.start}-{held.stop - 1} of {depth} "
                 f"(blocks per stage {','.join(map(str, layers))})")
    return layers


class Pipeline(nn.Module):
    """The model a pipeline-parallel rank runs: its stage (`stage`: the cut ViT, maybe under FSDP or compiled), the
    point-to-point links to its neighbours, and the schedules. Called like the serial model (validation, the first
    step's report), it runs the whole batch through the stages and every stage gets the last stage's output."""

    def __init__(self, stage, raw, grid, dtype=torch.float32):
        super().__init__()
        self.stage, self.grid = stage, grid
        self.raw = [raw]  # the cut ViT itself (not a submodule twice): its shapes and which stage it is
        layout, pp = grid.layout, grid["pp"]
        self.P, self.s, self.M, self.schedule = layout.pp, pp.rank, layout.microbatches, layout.pp_schedule
        ranks = dist.get_process_group_ranks(pp.group) if pp.group is not None else [0]
        self.prev = ranks[self.s - 1] if self.s > 0 else None  # global ranks of the neighbouring stages
        self.next = ranks[self.s + 1] if self.s < self.P - 1 else None
        self.last_rank, self.pp_axis, self.dtype = ranks[-1], pp, dtype  # the Axis (comm.destroy lets go of its group)
        self.in_flight = 0  # microbatches whose activations this stage holds now, and the most in the last step
        self.peak_in_flight = 0
        self.fsdp = layout.fsdp

    # --- what crosses between stages ---------------------------------------------------------------------------

    def tokens_shape(self, batch):
        """(batch, tokens on this rank, embed_dim): a stage's input and output."""
        raw = self.raw[0]
        tokens = raw.sequence_shapes[raw.tp.rank] if raw.sequence_shapes else raw.cp_shapes[raw.cp.rank]
        return batch, tokens, raw.embed_dim

    def _exchange(self, sends=(), receives=()):
        """Post the sends [(tensor, rank)] and receives [(shape, rank)] together and wait for all (posted as one
        batch: NCCL would deadlock on a send and a receive between the same two ranks posted one after the other).
        Returns the received tensors."""
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), peer, self.pp_axis.group) for tensor, peer in sends]
        got = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape, _ in receives]
        ops += [dist.P2POp(dist.irecv, tensor, peer, self.pp_axis.group) for tensor, (_, peer) in zip(got, receives)]
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return got

    @property
    def device(self):
        return next(self.stage.parameters()).device

    def recv_forward(self, batch):
        if self.prev is None:
            return None
        return self._exchange(receives=[(self.tokens_shape(batch), self.prev)])[0].requires_grad_()

    def send_forward(self, y):
        if self.next is not None:
            self._check(y)
            self._exchange(sends=[(y.detach(), self.next)])

    def recv_backward(self, batch):
        return self._exchange(receives=[(self.tokens_shape(batch), self.next)])[0] if self.next is not None else None

    def send_backward(self, x):
        if self.prev is not None:
            self._exchange(sends=[(x.grad, self.prev)])

    def send_forward_recv_backward(self, y, batch):
        if self.next is None:
            return None
        self._check(y)
        return self._exchange(sends=[(y.detach(), self.next)], receives=[(self.tokens_shape(batch), self.next)])[0]

    def send_backward_recv_forward(self, x, batch):
        if self.prev is None:
            return None
        got = self._exchange(sends=[(x.grad, self.prev)], receives=[(self.tokens_shape(batch), self.prev)])[0]
        return got.requires_grad_()

    def _check(self, y):
        if y.dtype != self.dtype or tuple(y.shape) != self.tokens_shape(y.shape[0]):
            raise ValueError(f"stage {self.s} made {tuple(y.shape)} {y.dtype} tokens; the next stage expects "
                             f"{self.tokens_shape(y.shape[0])} {self.dtype}")

    # --- one microbatch on this stage --------------------------------------------------------------------------

    def forward_one(self, x, inp, tar, run):
        """The stage's forward on microbatch input `x` (received; the fields `inp` on the first stage); on the last,
        the loss (over M). Returns (output, loss or None)."""
        with run.autocast:
            y = self.stage(inp if x is None else x)
            loss = None
            if self.next is None:
                loss = run.loss_fn(y, tar)
                loss = loss / self.M if DIVIDE_LOSS else loss
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return y, loss

    def backward_one(self, y, loss, dy, run):
        """The stage's backward: from the scaled loss on the last stage, else from the next stage's gradient `dy`."""
        if loss is not None:
            run.scale(loss).backward()
        else:
            torch.autograd.backward(y, dy)
        self.in_flight -= 1

    # --- the step ----------------------------------------------------------------------------------------------

    def forward_backward(self, inp, tar, loss_fn, autocast, scale):
        """One step's forward and backward passes over the M microbatches by the layout's schedule, then the
        gradients reduced over dp. Returns (the last stage's prediction of the batch, or an empty tensor on the
        other stages; the batch's loss, on every stage)."""
        run = Run(loss_fn, autocast, scale)
        scale(torch.ones((), device=inp.device))  # fp16: every stage's scaler holds the scale (only the last scales)
        micro = list(zip(inp.chunk(self.M), tar.chunk(self.M)))
        self.in_flight = self.peak_in_flight = 0
        schedule = gpipe if self.schedule == "gpipe" else one_f_one_b
        outputs, losses = schedule(self, micro, run)
        if not self.fsdp:
            reduce_gradients(self.grid, self.stage)
        loss = torch.stack(losses).sum() if losses else torch.zeros((), device=inp.device)
        loss = self._from_last(loss.detach().float().reshape(1)).reshape(())
        gen = torch.cat(outputs) if outputs else torch.empty(0, device=inp.device)
        return gen, loss

    def _from_last(self, tensor):
        """`tensor` as the last stage holds it, on every stage (same shape and dtype everywhere)."""
        if self.pp_axis.group is not None:
            dist.broadcast(tensor, src=self.last_rank, group=self.pp_axis.group)
        return tensor

    def forward(self, inp):
        """The whole batch through the stages (no microbatches): the last stage's output, on every stage."""
        y = self.stage(inp) if self.prev is None else self.stage(self.recv_forward(inp.shape[0]).detach())
        if self.next is not None:
            self.send_forward(y)
        raw = self.raw[0]
        shape = (inp.shape[0], raw.out_chans, raw.h * raw.patch_size, raw.w * raw.patch_size)
        header = torch.tensor([0 if y.dtype == torch.float32 else 1 if y.dtype == torch.bfloat16 else 2],
                              device=inp.device)
        kind = self._from_last(header).item()  # the head's dtype under autocast (bf16, fp16) or fp32
        out = y if self.next is None else torch.empty(shape, dtype=(torch.float32, torch.bfloat16, torch.float16)[kind],
                                                      device=inp.device)
        return self._from_last(out.contiguous())


class Run:
    """What a schedule needs of the training script: the loss, autocast, and the loss scaler's scale."""

    def __init__(self, loss_fn, autocast, scale):
        self.loss_fn, self.autocast, self.scale = loss_fn, autocast, scale


def gpipe(pipe, micro, run):
    """GPipe: every microbatch's forward, then every backward (in the same order). Returns the last stage's outputs
    and losses (empty lists elsewhere)."""
    held, outputs, losses = [], [], []
    for inp, tar in micro:
        x = pipe.recv_forward(inp.shape[0])
        y, loss = pipe.forward_one(x, inp, tar, run)
        pipe.send_forward(y)
        held.append((x, y, loss))
    for i in range(len(micro)):
        dy = pipe.recv_backward(micro[i][0].shape[0])
        x, y, loss = held[i]
        if not BACKWARD_IN_ORDER and loss is None:  # the twin: the gradient of microbatch i into the next one's
            x, y, loss = held[(i + 1) % len(held)]
        pipe.backward_one(y, loss, dy, run)
        if x is not None:
            pipe.send_backward(x)
        if loss is not None:
            outputs.append(y.detach())
            losses.append(loss.detach())
        if BACKWARD_IN_ORDER:  # (the twin reads the next one's later)
            held[i] = None  # its output and input go now, as 1F1B's do
    return outputs, losses


def one_f_one_b(pipe, micro, run):
    """1F1B: warm-up (P - s - 1 forwards), steady state (one forward, one backward), cool-down (the backwards
    left). Returns the last stage's outputs and losses (empty lists elsewhere)."""
    M = len(micro)
    warmup = min(pipe.P - pipe.s - 1 + WARMUP_OFFSET, M)
    held, outputs, losses = collections.deque(), [], []
    batch = micro[0][0].shape[0]

    def backward(dy):
        x, y, loss = held.popleft()
        pipe.backward_one(y, loss, dy, run)
        if loss is not None:
            outputs.append(y.detach())
            losses.append(loss.detach())
        return x

    for i in range(max(warmup, 0)):
        x = pipe.recv_forward(batch)
        y, loss = pipe.forward_one(x, *micro[i], run)
        pipe.send_forward(y)
        held.append((x, y, loss))
    steady = M - warmup
    x = pipe.recv_forward(batch) if steady > 0 else None
    for j in range(steady):
        i = warmup + j
        y, loss = pipe.forward_one(x, *(micro[i] if i < M else micro[-1]), run)  # i >= M: only the warm-up's twin
        held.append((x, y, loss))
        dy = pipe.send_forward_recv_backward(y, batch)
        done = backward(dy)
        if j == steady - 1:
            if done is not None:
                pipe.send_backward(done)
        else:
            x = pipe.send_backward_recv_forward(done, batch) if done is not None else None
    for _ in range(max(warmup, 0)):
        done = backward(pipe.recv_backward(batch))
        if done is not None:
            pipe.send_backward(done)
    return outputs, losses


def train_step(pipe, optimizer, scaler, loss_fn, autocast):
    """train_mp.py's step under pipeline parallelism: the schedule's forward and backward passes, then the optimizer
    (its fp16 skip agreed over the stages by the scaler's group). Returns step(inp, tar) -> (prediction, loss)."""
    def step(inp, tar):
        optimizer.zero_grad(set_to_none=True)
        gen, loss = pipe.forward_backward(inp, tar, loss_fn, autocast, scaler.scale)
        scaler.step(optimizer)
        scaler.update()
        return gen, loss
    return step


@torch.no_grad()
def reduce_gradients(grid, stage):
    """What DDP's hook does once a step, after the pipeline's last backward: the sums over cp and tp of the marked
    gradients (data_parallel.reduce_marked_gradients), then the average over "dp"."""
    params = [p for p in stage.parameters() if p.grad is not None]
    if not params:
        return
    reduce_marked_gradients(grid, params, [p.grad for p in params])
    if grid.size("dp") > 1:
        all_reduce_in_place([p.grad.div_(grid.size("dp")) for p in params], grid["dp"])
