"""``plugtron train``."""

from __future__ import annotations

import copy
import os

import click
from plugtron.core.config_freeze import freeze
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.distributed import launched_externally
from plugtron.core.plugins import registry
from plugtron.core.plugins.selection import selected_driver, selected_drivers
from plugtron.core.training.validate import validate

from .errors import user_errors
from .launch import JobStopped, Nodes, launch_local_ranks
from .options import (
    SectionedCommand,
    build_config,
    config_options,
    declared_sections,
    headings,
    model_presets,
    prescan,
)
from .preflight import check_memory, preflight


def check_plugins(config) -> None:
    """Unknown or broken plugins are reported before any rank starts."""
    for role, name in selected_drivers(config).items():
        registry.load(role, name)
    backend_cls = registry.load("layer_backend", selected_driver(config, "layer_backend"))
    if hasattr(backend_cls, "check_available"):
        backend_cls.check_available()  # e.g. te without transformer-engine or CUDA


def check_data_paths(config) -> None:
    """Files, folders or Megatron prefixes (PREFIX.idx); blend weights are numbers."""
    for path in config.data.data_path:
        if os.path.exists(path) or os.path.exists(f"{path}.idx"):
            continue
        try:
            float(path)
        except ValueError:
            raise ConfigError(f"--data-path {path!r} does not exist") from None


def check_load(config) -> None:
    """``--load``: the whole checkpoint is validated (names, headers, pieces) before any rank
    starts, so a hostile or broken one is refused in seconds, not after the model is built."""
    from plugtron.core.checkpoint import CheckpointReader, layout

    path = config.checkpoint.load
    if not path:
        return
    save = config.checkpoint.save
    if save and os.path.abspath(save) == os.path.abspath(path) and not layout.has_checkpoint(path):
        if config.checkpoint.exit_on_missing_checkpoint:
            raise ConfigError(f"--exit-on-missing-checkpoint: --load {path} has no checkpoint "
                              f"yet; leave the flag out to start from scratch there")
        return  # --load equal to --save with nothing saved yet: a fresh start
    CheckpointReader(path).close()
    from plugtron.core.plugins.tokenizers import check_checkpoint_tokenizer

    check_checkpoint_tokenizer(config)


def ranks_on_node(external: bool, nproc_per_node: int) -> int:
    """Ranks sharing this node's host memory: torchrun's LOCAL_WORLD_SIZE, or ours."""
    if external:
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    return nproc_per_node


def parse_nnodes(value: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` (torchrun's elastic form) -> (min, max)."""
    text = str(value).strip()
    low, sep, high = text.partition(":")
    try:
        lo, hi = (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise ConfigError(f"--nnodes {text!r}: give a number of nodes N, or MIN:MAX for an "
                          f"elastic job that may lose nodes (e.g. 1:2)") from None
    if not 1 <= lo <= hi:
        raise ConfigError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return lo, hi


#: torch elastic's c10d rendezvous settings ``--rdzv-conf`` passes on: seconds, or counts
RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                  "keep_alive_interval", "keep_alive_max_attempt", "read_timeout")
#: ... and whether this node's launcher hosts the rendezvous's store (else: the endpoint's host)
RDZV_CONF_FLAGS = ("is_host",)
TRUE_FALSE = {"1": "1", "true": "1", "yes": "1", "0": "0", "false": "0", "no": "0"}


def parse_rdzv_conf(text: str | None) -> tuple[tuple[str, str], ...]:
    """``--rdzv-conf KEY=VALUE[,KEY=VALUE]`` (torchrun's form) -> ((key, value), ...)."""
    if not text:
        return ()
    out = []
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if key in RDZV_CONF_FLAGS:
            if value.lower() not in TRUE_FALSE:
                raise ConfigError(f"--rdzv-conf {text!r}: {key} is true or false (1 or 0)")
            out.append((key, TRUE_FALSE[value.lower()]))
            continue
        if key not in RDZV_CONF_KEYS:
            raise ConfigError(f"--rdzv-conf {text!r}: unknown setting {key!r}; allowed: "
                              f"{', '.join(RDZV_CONF_KEYS + RDZV_CONF_FLAGS)}")
        if not sep or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"--rdzv-conf {text!r}: {key} needs a whole number of at least "
                              f"1 (seconds, or attempts), as {key}=10")
        out.append((key, value))
    return tuple(out)


def node_layout(external: bool, nnodes: str | int, node_rank: int, master_addr: str | None,
                master_port: int, rdzv_endpoint: str | None, max_restarts: int,
                rdzv_conf: str | None = None) -> Nodes:
    """The ``--nnodes`` options, checked: what torchrun is told on this node."""
    min_nodes, nnodes = parse_nnodes(str(nnodes))
    several = nnodes > 1 or max_restarts > 0
    conf = parse_rdzv_conf(rdzv_conf)
    if conf and not several:
        raise ConfigError("--rdzv-conf sets the rendezvous of several nodes or of restarts: "
                          "give it with --nnodes or --max-restarts")
    if external and (several or node_rank):
        raise ConfigError("--nnodes, --node-rank and --max-restarts start ranks; under torchrun "
                          "(or srun with several tasks) the launcher already did: give them to "
                          "torchrun, or run one plugtron launcher per node with "
                          "PLUGTRON_SLURM=0 (docs/clusters.md)")
    if node_rank >= nnodes:
        raise ConfigError(f"--node-rank {node_rank} must be below --nnodes {nnodes}")
    if rdzv_endpoint and master_addr:
        raise ConfigError("give --rdzv-endpoint HOST:PORT or --master-addr/--master-port, not "
                          "both")
    endpoint = rdzv_endpoint or (f"{master_addr}:{master_port}" if master_addr else None)
    if nnodes > 1 and endpoint is None:
        raise ConfigError(f"--nnodes {nnodes}: say where the nodes meet, --master-addr HOST "
                          f"(node 0's host; --master-port, default 29500) or --rdzv-endpoint "
                          f"HOST:PORT")
    if several and endpoint is None:
        endpoint = "127.0.0.1:0"  # one node restarting: a rendezvous of its own
    if endpoint is not None:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"--rdzv-endpoint {endpoint!r} must be HOST:PORT")
    if min_nodes < nnodes and max_restarts == 0:
        raise ConfigError(f"--nnodes {min_nodes}:{nnodes}: the group re-forms without a lost node "
                          f"only by restarting; add --max-restarts K")
    return Nodes(nnodes, node_rank, endpoint, max_restarts, min_nodes, conf)


def flag_argument(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


def load_argument(args: list[str]) -> str | None:
    return flag_argument(args, "--load")


def given_model(config) -> str | None:
    """The model the flags name, or None for ``auto``: an HF directory's converter is then
    the one that reads its model_type (resolved at import, not while click builds the
    command, so a missing model plugin is reported as a user error)."""
    return None if config.plugins.model == "auto" else config.plugins.model


class HFLoad:
    """``--load HF_DIR`` (or a fine-tune's ``--pretrained-checkpoint HF_DIR``): the imported
    model's config (``base``, whose --load is the cached checkpoint) and the settings the
    import fixed (``flags``); ``error`` if it cannot be imported (reported when the command
    runs, not while click builds it)."""

    def __init__(self, args: list[str], model: str | None):
        from plugtron.core.errors import PlugtronError
        from plugtron.core.interchange import hf_load

        self.dir, self.base, self.flags, self.error = load_argument(args), None, {}, None
        self.flag = "--load"
        if self.dir is None or not hf_load.is_hf_dir(self.dir):
            self.dir, self.flag = flag_argument(args, "--pretrained-checkpoint"), \
                "--pretrained-checkpoint"
        if self.dir is None or not hf_load.is_hf_dir(self.dir):
            self.dir = None
            return
        try:
            self.base, self.flags = hf_load.hf_base(self.dir, model)
        except PlugtronError as exc:
            self.error = exc

    def config_base(self):
        if self.error is not None:
            raise self.error
        return copy.deepcopy(self.base) if self.base is not None else None

    def finish(self, config) -> None:
        """--load points at the cached checkpoint; nothing contradicts config.json."""
        from plugtron.core.interchange.hf_load import check_agrees, is_hf_dir

        if self.base is not None and self.dir is not None:
            cached = self.base.checkpoint.load
            if self.flag == "--load":
                config.checkpoint.load = cached
            else:  # the base a fine-tune starts from; --load stays the run's own
                config.checkpoint.pretrained_checkpoint = cached
                if config.checkpoint.load == cached:
                    config.checkpoint.load = None
            check_agrees(config, self.base, self.flags, self.dir)
        for field, flag in (("load", "--load"),
                            ("pretrained_checkpoint", "--pretrained-checkpoint")):
            if is_hf_dir(getattr(config.checkpoint, field)):  # from a config file: too late
                raise ConfigError(f"{field} {getattr(config.checkpoint, field)!r} (a Hugging "
                                  f"Face directory) must be given on the command line as "
                                  f"{flag}, so that its model settings are known before the "
                                  f"options are built")


class RunOptions:
    """What a command taking the run's flags (``train``, ``estimate``) builds from ``args``:
    the Hugging Face ``--load`` directory if any, the plugins' option sections and the
    selected model's presets, and :meth:`command`, the click command with ``--config``,
    ``--preset`` and every section's options around the command's own function."""

    def __init__(self, args: list[str]):
        self.hf = HFLoad(args, given_model(prescan(args)))
        selection = prescan(args, self.hf.base and copy.deepcopy(self.hf.base))
        self.declared = declared_sections(selection)
        self.presets = model_presets(selection)

    def command(self, *own_options):
        def wrap(fn):
            for option in reversed(own_options):
                fn = option(fn)
            fn = click.option("--preset", help="Named model size of the selected model: "
                              + (", ".join(sorted(self.presets)) or "none"))(fn)
            fn = click.option("--config", "config_file", type=click.Path(dir_okay=False),
                              help="YAML or TOML file of settings; flags override it.")(fn)
            return click.command(cls=SectionedCommand, headings=headings(self.declared),
                                 context_settings={"max_content_width": 100})(fn)
        return wrap

    def config(self, params: dict, config_file, preset):
        config = build_config(params, config_file, preset, base=self.hf.config_base(),
                              declared=self.declared, presets=self.presets)
        self.hf.finish(config)
        return config


def make_train_command(args: list[str]) -> click.Command:
    """The ``train`` command with the options of the plugins that ``args`` select."""
    run = RunOptions(args)

    @run.command(
        click.option("--nproc-per-node", type=click.IntRange(min=1), default=1,
                     show_default=True,
                     help="Launch this many local ranks (through torch.distributed.run)."),
        click.option("--nnodes", default="1", show_default=True, metavar="N|MIN:MAX",
                     help="Nodes of the job: run this command once on each, with its "
                     "--node-rank; they meet at --rdzv-endpoint (or --master-addr and "
                     "--master-port). MIN:MAX: elastic, with --max-restarts the survivors of a "
                     "lost node re-form (at least MIN nodes) and resume from the checkpoint."),
        click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True,
                     help="This node's index, 0 .. --nnodes - 1 (node 0 holds the save lock)."),
        click.option("--master-addr", default=None,
                     help="Host of node 0, where the nodes meet (torch elastic's c10d "
                     "rendezvous)."),
        click.option("--master-port", type=click.IntRange(min=1, max=65535), default=29500,
                     show_default=True, help="Port of that rendezvous on --master-addr."),
        click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                     help="The rendezvous as torchrun names it (instead of --master-addr and "
                     "--master-port)."),
        click.option("--rdzv-conf", default=None, metavar="KEY=VALUE[,...]",
                     help="Settings of torch elastic's c10d rendezvous, as torchrun takes them "
                     "(e.g. last_call_timeout=5: how long the survivors of a lost node wait for "
                     "more nodes, 30 s by default; join_timeout, close_timeout, "
                     "heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt, "
                     "read_timeout; is_host=0 on the nodes that do not hold the endpoint)."),
        click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Restart the worker group this many times when a rank fails (torch "
                     "elastic); with --save and --load the run resumes from its latest "
                     "checkpoint."),
        click.option("--no-memory-check", "no_memory_check", is_flag=True,
                     help="Launch even when the memory estimate (plugtron estimate) exceeds "
                     "the memory of a rank."),
        config_options(run.declared), user_errors)
    def train(config_file, preset, nproc_per_node, nnodes, node_rank, master_addr, master_port,
              rdzv_endpoint, rdzv_conf, max_restarts, no_memory_check, **params):
        """Train a model. Under torchrun (or any launcher setting RANK/WORLD_SIZE) each rank
        joins that world; otherwise --nproc-per-node local ranks are started (on each of
        --nnodes nodes)."""
        config = run.config(params, config_file, preset)
        external = launched_externally()
        if external and nproc_per_node > 1:
            raise ConfigError("--nproc-per-node cannot be used under torchrun or srun with "
                              "several tasks: the launcher already started the ranks (one "
                              "plugtron launcher per node under SLURM: set PLUGTRON_SLURM=0)")
        nodes = node_layout(external, nnodes, node_rank, master_addr, master_port,
                            rdzv_endpoint, max_restarts, rdzv_conf)
        world_size = int(os.environ["WORLD_SIZE"]) if external else nproc_per_node * nodes.count
        check_plugins(config)
        preflight(config, world_size, memory_check=False)
        validate(config, world_size)
        if nodes.min_count is not None and nodes.min_count < nodes.count:
            # An elastic group may re-form with any node count in between: each must fit.
            for count in range(nodes.min_count, nodes.count):
                try:
                    validate(config, nproc_per_node * count)
                except ConfigError as exc:
                    raise ConfigError(f"--nnodes {nodes.nnodes}: the group may re-form with "
                                      f"{count} node(s) ({nproc_per_node * count} ranks), "
                                      f"where {exc}") from None
        freeze(config)  # validated: nothing after this changes a setting
        check_data_paths(config)
        if not no_memory_check:
            check_memory(config, world_size, ranks_on_node(external, nproc_per_node))
        if config.checkpoint.save and int(os.environ.get("RANK", 0)) == 0 and node_rank == 0:
            from plugtron.core.checkpoint import dir_lock

            # Held until this process exits; taking it also repairs crashed saves. Taken here,
            # before any rank starts, so a second run is refused at once; the ranks' own
            # pretrain() counts it as held (core/checkpoint/dir_lock.py).
            dir_lock.acquire(config.checkpoint.save)
            os.environ[dir_lock.INHERITED_ENV] = os.path.abspath(config.checkpoint.save)
        check_load(config)
        if nproc_per_node > 1 or nodes.several:
            launch_local_ranks(config.to_json(), nproc_per_node, nodes=nodes)
            return
        from plugtron.core.parallel.distributed import init_distributed, timeout_seconds
        from plugtron.core.training import preemption
        from plugtron.core.training.loop import pretrain

        # After joining the world: a signal while a restarted rank waits for its peers there
        # ends it at once (torch elastic stops a failed group with SIGTERM), nothing to save.
        init_distributed(timeout_seconds(config))
        preemption.install(extra=config.training.exit_signal_handler)
        pretrain(config)
        if preemption.stopped is not None:
            raise JobStopped(preemption.final_message(config), preemption.stopped[1])

    return train
