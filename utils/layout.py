"""The parallel layout of a run, built once from the flags and checked in one place.

A layout is how the job's ranks split the work: tp ranks split each layer's weights (tensor parallelism), cp ranks
split each sample's tokens (context parallelism), and the dp groups of those each train on their own share of the
batch (data parallelism); pp ranks each hold a stage of consecutive blocks, through which microbatches
flow (pipeline parallelism, distributed/pipeline.py: dp = world / (tp x cp x pp)). The order (first name
fastest, utils/rank_generator.py) places the groups on the nodes; pp, if the order leaves it out, is the slowest.
Three memory switches ride on it: sequence parallelism, activation checkpointing and FSDP; and how the cp ranks'
attention meets the other ranks' keys and values (`cp_method`, distributed/context_parallel.py).

Every rule a layout must obey is one function in RULES, here and nowhere else. A rule needs some facts about the
run (the world size, the model's heads, the global batch, ...) and is checked wherever those facts are known:
comm.init checks the world size, the ViT its shape and dropout, parallelize the flags FSDP replaces, the batch
split its batch, the planner (planning/plan.py) every fact at once without starting a process. The rules that
need no fact are checked whenever a Layout is made, so a Layout that exists is a layout that can run.
"""
from dataclasses import dataclass

from utils.errors import UserError
from utils.rank_generator import RankGenerator

DEFAULT_ORDER = "tp-cp-dp"
# how attention reaches the keys and values of the other cp ranks (distributed/context_parallel.py): all-gather them
# (the original's), pass them around a ring, or swap sequence shards for head shards with all-to-all (Ulysses)
CP_METHODS = ("allgather", "ring", "alltoall")
DEFAULT_CP_METHOD = CP_METHODS[0]
# how a pipeline's stages order the forward and backward passes of the microbatches (distributed/pipeline.py): all
# forwards then all backwards (GPipe), or one forward one backward after a warm-up (1F1B, the default)
PP_SCHEDULES = ("gpipe", "1f1b")
DEFAULT_PP_SCHEDULE = "1f1b"
# A dry run (planning/dry_run.py) builds every process group of its world in this one process (comm._build_groups:
# about 0.1 ms and 0.3 KB a rank on a CPU core; 2^17 ranks take about 10 s, 10^8 ranks would take hours and over
# 20 GB): 2^17 = 131072 ranks, above the largest GPU jobs run today (about 100,000 GPUs), is as many as it stands in
# for.
DRY_RUN_MAX_RANKS = 2 ** 17
RULES = []  # (facts needed, rule) in the order they are checked; a rule returns the refusal's line or None


def rule(*facts):
    """Register a rule that needs `facts` (keyword names of Layout.check)."""
    def register(function):
        RULES.append((facts, function))
        return function
    return register


@dataclass(frozen=True)
class Axis:
    """One named group of the grid ("tp", "cp", "dp", "tp-cp", "dp-cp"): its size and this rank's place in it, from
    the layout's numbers, and its process group (None: not distributed, size 1)."""
    name: str
    size: int = 1
    rank: int = 0
    group: object = None

    def __deepcopy__(self, memo):
        return self  # a process group is a handle to share, not state: a deep copy of a model keeps its groups

    def let_go(self):
        """Drop the process group (the run leaves it: utils/comm.forget_groups); size and rank stay. Whatever holds
        this Axis (the grid, the model's layers) then keeps no group alive past the teardown."""
        object.__setattr__(self, "group", None)


GROUP_SIZES = {"tp": lambda layout: layout.tp, "cp": lambda layout: layout.cp, "dp": lambda layout: layout.dp,
               "tp-cp": lambda layout: layout.tp * layout.cp, "dp-cp": lambda layout: layout.dp * layout.cp,
               "pp": lambda layout: layout.pp, "tp-cp-pp": lambda layout: layout.tp * layout.cp * layout.pp}


class Grid:
    """The run's grid, handed down from comm.init to whatever splits the model (distributed/parallelize.py): the
    layout, and each named group as an Axis. A name the grid does not hold is a group of one (size 1, rank 0), so
    code written for tp and cp also runs serially."""

    def __init__(self, layout=None, axes=None):
        self.layout = layout or Layout()
        self.axes = dict(axes or {})

    def __getitem__(self, name):
        return self.axes.get(name) or Axis(name)

    def size(self, name):
        return self[name].size

    def rank(self, name):
        return self[name].rank

    def split(self):
        """Names of the groups larger than one rank other than "dp" (over which the model itself is split)."""
        return [name for name, axis in self.axes.items() if name != "dp" and axis.size > 1]

    def describe(self):
        return self.layout.describe()


@dataclass(frozen=True)
class Layout:
    """tp x cp x dp x pp ranks laid out in `order` (first name fastest), the memory switches of train_mp.py, and the
    pipeline's microbatches, schedule and blocks per stage (None: balanced, distributed/pipeline.py)."""
    tp: int = 1
    cp: int = 1
    dp: int = 1
    order: str = DEFAULT_ORDER
    sequence_parallel: bool = False
    checkpointing: bool = False
    fsdp: bool = False
    cp_method: str = DEFAULT_CP_METHOD
    pp: int = 1
    microbatches: int = 1
    pp_schedule: str = DEFAULT_PP_SCHEDULE
    pp_layers: tuple = None

    def __post_init__(self):
        self.check()  # the rules that need no fact

    @classmethod
    def for_world(cls, world_size, tp=1, cp=1, **switches):
        """The layout of `world_size` ranks with these tp and cp (and pp, among the switches): dp is what is left."""
        Layout(tp=tp, cp=cp, **switches).check(world_size=world_size)
        return cls(tp=tp, cp=cp, dp=world_size // (tp * cp * switches.get("pp", 1)), **switches)

    @classmethod
    def from_flags(cls, args, world_size):
        """train_mp.py's layout: --tensor_parallel, --context_parallel, --parallel_order, --sequence_parallel,
        --activation_checkpointing, --fsdp, --cp_method, --pipeline_parallel, --num_microbatches (default: as many as
        stages), --pp_schedule, --pp_layers."""
        pp = getattr(args, "pipeline_parallel", 1)
        return cls.for_world(world_size, args.tensor_parallel, args.context_parallel, order=args.parallel_order,
                             sequence_parallel=args.sequence_parallel, checkpointing=args.activation_checkpointing,
                             fsdp=getattr(args, "fsdp", False),
                             cp_method=getattr(args, "cp_method", DEFAULT_CP_METHOD), pp=pp,
                             microbatches=getattr(args, "num_microbatches", None) or pp,
                             pp_schedule=getattr(args, "pp_schedule", DEFAULT_PP_SCHEDULE),
                             pp_layers=parse_pp_layers(getattr(args, "pp_layers", None)))

    @classmethod
    def from_dict(cls, params, world_size):
        """The original's comm.init(params): "tp", "cp" and "order" keys (a dict or the config; missing means 1), and
        "cp_method" (missing: all-gather, the original's)."""
        return cls.for_world(world_size, params.get("tp", 1), params.get("cp", 1),
                             order=params.get("order", DEFAULT_ORDER),
                             cp_method=params.get("cp_method", DEFAULT_CP_METHOD))

    @property
    def world_size(self):
        return self.tp * self.cp * self.dp * self.pp

    @property
    def model_parallel(self):
        """Ranks that hold parts of one model (tp x cp)."""
        return self.tp * self.cp

    def grid(self):
        """The rank lists of every process group (utils/rank_generator.py)."""
        named = self.pp == 1 or "pp" in str(self.order).lower().split("-")
        order = self.order if named else f"{self.order}-pp"  # pp, unnamed: the slowest
        return RankGenerator(tp=self.tp, dp=self.dp, pp=self.pp, cp=self.cp, order=order)

    def refusal(self, **facts):
        """The first broken rule's line among those whose facts are given (None: every one holds)."""
        for needs, check in RULES:
            if all(facts.get(name) is not None for name in needs):
                line = check(self, *(facts[name] for name in needs))
                if line:
                    return line
        return None

    def check(self, **facts):
        """Refuse, in one UserError line, a layout that breaks a rule with these facts."""
        line = self.refusal(**facts)
        if line:
            raise UserError(line)
        return self

    def flags(self):
        """train_mp.py's flags for this layout."""
        flags = [f"--tensor_parallel={self.tp}", f"--context_parallel={self.cp}"]
        if self.order != DEFAULT_ORDER:
            flags.append(f"--parallel_order={self.order}")
        if self.cp_method != DEFAULT_CP_METHOD:
            flags.append(f"--cp_method={self.cp_method}")
        if self.pp > 1:
            flags += [f"--pipeline_parallel={self.pp}", f"--num_microbatches={self.microbatches}",
                      f"--pp_schedule={self.pp_schedule}"]
            flags += [f"--pp_layers={','.join(map(str, self.pp_layers))}"] if self.pp_layers else []
        return flags + [flag for flag, on in (("--sequence_parallel", self.sequence_parallel),
                                              ("--activation_checkpointing", self.checkpointing),
                                              ("--fsdp", self.fsdp)) if on]

    def describe(self):
        """The grid in one phrase (logged at start); the cp method only where it is not the default all-gather."""
        method = f" ({self.cp_method})" if self.cp_method != DEFAULT_CP_METHOD else ""
        pipeline = f" ({self.pp_schedule}, {self.microbatches} microbatches)" if self.pp > 1 else ""
        return f"DP = {self.dp}, TP = {self.tp}, CP = {self.cp}{method}, PP = {self.pp}{pipeline}"

    @property
    def name(self):
        """The run directory's layout part: '<tp x cp>MP', and '<pp>PP' with a pipeline."""
        return f"{self.model_parallel}MP" + (f"{self.pp}PP" if self.pp > 1 else "")


def parse_pp_layers(text):
    """--pp_layers '5,6,6,7' -> (5, 6, 6, 7); None stays None (balanced stages)."""
    if text is None or isinstance(text, tuple):
        return text
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise UserError(f"--pp_layers {text!r} is not a list of block counts; give one whole number a stage, joined "
                        "by commas, e.g. 5,6,6,7") from None


def dry_run_refusal(world_size):
    """Why a dry run of `world_size` ranks cannot run (one line without the flag's name), or None."""
    if world_size > DRY_RUN_MAX_RANKS:
        return (f"{world_size} ranks is more than a dry run stands in for: it builds every process group of the "
                f"layout in this one process (about 0.1 ms a rank), so it takes at most {DRY_RUN_MAX_RANKS} ranks "
                "(2^17, more than the largest GPU jobs); give a smaller N")
    return None


# --- the rules, each a line saying what to change ---------------------------------------------------------------

@rule()
def sizes_are_whole_numbers(layout):
    for name in ("tp", "cp", "dp", "pp"):
        size = getattr(layout, name)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            return f"{name} is {size!r}; give a whole number of ranks, at least 1 (1 turns it off)"
    return None


@rule()
def order_names_each_dimension(layout):
    try:
        layout.grid()
    except UserError as err:
        return str(err)
    return None


@rule()
def sequence_parallel_needs_tp(layout):
    if layout.sequence_parallel and layout.tp < 2:
        return ("--sequence_parallel splits the tokens over the tensor-parallel group; it needs --tensor_parallel 2 "
                "or more")
    return None


@rule()
def cp_method_is_known(layout):
    if layout.cp_method not in CP_METHODS:
        return (f"--cp_method {layout.cp_method!r} is not a context-parallel method; choose one of "
                f"{', '.join(CP_METHODS)}")
    return None


@rule()
def pipeline_schedule_is_known(layout):
    if layout.pp_schedule not in PP_SCHEDULES:
        return (f"--pp_schedule {layout.pp_schedule!r} is not a pipeline schedule; choose one of "
                f"{', '.join(PP_SCHEDULES)}")
    return None


@rule()
def enough_microbatches_for_the_stages(layout):
    if isinstance(layout.microbatches, bool) or not isinstance(layout.microbatches, int) or layout.microbatches < 1:
        return f"--num_microbatches is {layout.microbatches!r}; give a whole number, at least 1"
    if layout.pp > 1 and layout.microbatches < layout.pp:
        return (f"--num_microbatches {layout.microbatches} is fewer than the {layout.pp} pipeline stages: a stage "
                f"would wait for work that never comes to it in a step; give --num_microbatches {layout.pp} or more "
                "(more microbatches, a smaller idle share)")
    return None


@rule()
def stage_sizes_are_given_for_each_stage(layout):
    if layout.pp_layers is not None and (len(layout.pp_layers) != layout.pp or min(layout.pp_layers) < 1):
        return (f"--pp_layers {','.join(map(str, layout.pp_layers))} gives {len(layout.pp_layers)} stage(s) for "
                f"--pipeline_parallel {layout.pp}; give {layout.pp} block counts, each at least 1")
    return None


@rule("depth")
def stages_hold_the_blocks(layout, depth):
    if layout.pp > 1 and layout.pp > depth:
        return (f"--pipeline_parallel {layout.pp} is more stages than the model's {depth} blocks (each stage holds at "
                f"least one); choose --pipeline_parallel {depth} or fewer")
    if layout.pp > 1 and layout.pp_layers is not None and sum(layout.pp_layers) != depth:
        return (f"--pp_layers {','.join(map(str, layout.pp_layers))} adds up to {sum(layout.pp_layers)} blocks; the "
                f"model has {depth}; give counts that add up to {depth} (or leave --pp_layers out for balanced stages)")
    return None


@rule("world_size")
def grid_divides_world(layout, world_size):
    if world_size % layout.world_size:
        tp, cp, pp = layout.tp, layout.cp, layout.pp
        split, names = (tp * cp, f"tp x cp = {tp} x {cp}") if pp == 1 else (tp * cp * pp,
                                                                          f"tp x cp x pp = {tp} x {cp} x {pp}")
        return (f"{names} = {split} does not divide the world size {world_size} (the number of ranks); launch a "
                f"multiple of {split} ranks, or choose sizes whose product divides {world_size}")
    return None


@rule("num_heads")
def heads_split_over_tp(layout, num_heads):
    if num_heads % layout.tp:
        return (f"num_heads {num_heads} does not divide by tp = {layout.tp} (each tp rank holds whole heads); "
                f"choose tp among the divisors of {num_heads}, or change num_heads")
    return None


@rule("num_heads")
def heads_split_over_cp_for_alltoall(layout, num_heads):
    if layout.cp_method != "alltoall" or layout.cp < 2 or num_heads % layout.tp:  # the last: the rule above's
        return None
    heads = num_heads // layout.tp
    if heads % layout.cp:
        divisors = [str(size) for size in range(2, heads + 1) if heads % size == 0]
        choose = f"choose cp among {', '.join(divisors)}, or " if divisors else ""
        return (f"--cp_method alltoall splits the heads over cp: num_heads / tp = {num_heads} / {layout.tp} = {heads} "
                f"does not divide by cp = {layout.cp}; {choose}use --cp_method ring or allgather")
    return None


@rule("mlp_hidden")
def mlp_width_splits_over_tp(layout, mlp_hidden):
    if mlp_hidden % layout.tp:
        return (f"the MLP hidden width {mlp_hidden} does not divide by tp = {layout.tp} (each tp rank holds an equal "
                "slice); choose tp among its divisors, or change the MLP ratio or embed_dim")
    return None


@rule("tokens")
def every_cp_rank_has_tokens(layout, tokens):
    if tokens < layout.cp:
        return (f"the sequence has {tokens} patches, fewer than cp = {layout.cp} (each cp rank needs at least one); "
                "lower cp, or use smaller patches or larger images")
    return None


@rule("dropout")
def no_dropout_with_cp(layout, dropout):
    if layout.cp > 1 and float(dropout) > 0:
        return (f"dropout {dropout} with context parallelism (cp = {layout.cp}) would draw different masks for the "
                "chunks of one sample on each cp rank; set dropout: 0 for cp > 1")
    return None


@rule("dropout")
def no_dropout_with_sequence_parallel(layout, dropout):
    if layout.sequence_parallel and float(dropout) > 0:
        return (f"dropout {dropout} with --sequence_parallel would draw different masks for the tokens of one "
                "sample on each tp rank; set dropout: 0, or leave out --sequence_parallel")
    return None


@rule("noddp")
def fsdp_replaces_ddp(layout, noddp):
    if layout.fsdp and noddp:
        return "--fsdp replaces DDP: drop --noddp (or --fsdp)"
    return None


@rule("channels_last")
def fsdp_shards_contiguous_weights(layout, channels_last):
    if layout.fsdp and channels_last:
        return ("--fsdp shards contiguous parameters, and enable_nhwc makes the patch embedding's weight "
                "channels_last; add --no-enable_nhwc (or drop --fsdp)")
    return None


@rule("global_batch")
def batch_splits_over_dp(layout, global_batch):
    if global_batch % layout.dp or global_batch < layout.dp:
        return (f"cannot evenly distribute {global_batch} across {layout.dp} GPU: choose a global_batch_size "
                "divisible by the number of data-parallel ranks, or set --local_batch_size")
    local = global_batch // layout.dp
    if layout.pp > 1 and local % layout.microbatches:
        return (f"the local batch {local} (global {global_batch} over dp = {layout.dp}) does not split into "
                f"--num_microbatches {layout.microbatches} equal microbatches; choose a local batch that is a "
                f"multiple of {layout.microbatches} (--local_batch_size), or another --num_microbatches")
    return None
