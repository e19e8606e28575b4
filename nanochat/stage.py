"""
What the four training stages (scripts/base_train, mid_train, chat_sft, chat_rl) do around their training loop,
written once: start (fresh, or resumed from the stage's own checkpoint), save, agree with the other ranks on
when to stop, and end. The loop itself, with its micro-steps, stays written out in each script.

    stage = Stage("mid", config, device)                  # every rank; wandb on rank 0 unless --run=dummy
    model, tokenizer = stage.start(source="base", model_tag=model_tag, source_step=step)
    optimizers = model.setup_optimizers(...)
    stage.resume(optimizers, data_settings)                # a resumed run: optimizer state, checked settings
    train_loader.load_state_dict(stage.data_state)         # ... and where its data was
    stop_request = StopRequest(ddp_rank)
    while True:
        ...
        if last_step or ...: stage.save(step, optimizers, data_state=..., loop_state=...)
        ... the step, its micro-steps ...
        stop_now, = any_rank(stop_request.requested)       # all ranks stop after the same step
    stage.finish(step, stopped_early, "python -m scripts.chat_sft")   # exit 75 when stopped early

Exit codes (speedrun.sh stops at anything but 0): 0 = the stage reached its last step, 1 = a user error (one
line says what to do), 75 = stopped early on request, with a checkpoint to resume from.
"""

import math
import os
import signal
import sys
import time
import urllib.parse

import torch
import torch.distributed as dist

from nanochat.checkpoint_manager import (SOURCES, STAGE_COMMANDS, carry_tokenizer, check_data_settings,
                                         check_tokenizer, checkpoint_dir_for, checkpoint_tokenizer,
                                         claim_checkpoint_dir, find_model_tag, load_checkpoint, load_model,
                                         model_from_state, open_metrics, save_checkpoint)
from nanochat.common import UserError, any_rank, compute_cleanup, gather_from_ranks, get_base_dir, is_distributed, print0
from nanochat.optim import load_optimizer_shards, optimizer_shard

EXIT_STOPPED_EARLY = 75  # stopped before the planned last step (SIGTERM / Ctrl-C), a checkpoint saved: resume
#                          with --resume_from_step (75 = EX_TEMPFAIL of sysexits.h, "try again later")

WANDB_PROJECTS = {"base": "nanochat", "mid": "nanochat-mid", "sft": "nanochat-sft", "rl": "nanochat-rl"}


class StopRequest:
    """
    Stop a training stage cleanly on SIGTERM (a scheduler's "your time is up", `kill`) or SIGINT (Ctrl-C), within
    seconds, in any phase: a training step finishes; an evaluation or sampling stops at once (the phases take
    `stop=stop_request` and ask it between items: nanochat.common.Interrupted); then a checkpoint is saved (one
    already saved stays as it is) and the stage exits with EXIT_STOPPED_EARLY. A second signal kills at once.

    A signal may reach the ranks at different moments, or only one of them. At the end of a step the ranks combine
    their `requested` flags (any_rank) and all stop together. Within a phase, stop_request() is True once this
    rank got a signal or, under torchrun, once another rank did: the first to ask after its signal writes it into
    the process group's store, where the others look (at most every STORE_EVERY seconds), so that no rank goes on
    with a long evaluation while the others wait for it.
    """

    STORE_KEY, STORE_EVERY = "nanochat_stop_requested", 0.5

    def __init__(self, rank):
        self.rank, self.requested = rank, False
        self._store = self._last_look = None
        if is_distributed():
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except (AttributeError, RuntimeError):  # a torch without it: the ranks still agree at each step's end
                self._store = None
        self._posted = False
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        print(f"[rank {self.rank}] got {signal.Signals(signum).name}: stopping (a training step finishes, an evaluation or "
              f"sampling stops now), then saving a checkpoint (send it again to quit at once)", flush=True)
        self.requested = True
        signal.signal(signum, signal.SIG_DFL)

    def __call__(self):
        """True once a stop was requested of this run, here or (under torchrun) on another rank."""
        if self._store is None:
            return self.requested
        if self.requested:
            if not self._posted:  # here, not in the signal handler: a store call must not interrupt another one
                self._store.set(self.STORE_KEY, "1")
                self._posted = True
            return True
        now = time.monotonic()
        if self._last_look is None or now - self._last_look >= self.STORE_EVERY:
            self._last_look = now
            self.requested = self._store.check([self.STORE_KEY])
        return self.requested


# -----------------------------------------------------------------------------
# Experiment tracking: a wandb run on the master process, or a stand-in that logs nothing


class DummyWandb:
    """Stands in for a wandb run when tracking is off (run name "dummy", or a rank other than 0)."""

    def log(self, *args, **kwargs):
        pass

    def finish(self):
        pass


def init_wandb(run, master_process, config, project="nanochat"):
    """
    A real wandb run on the master process unless `run == "dummy"`; DummyWandb otherwise. Checked at
    start-up, before any training: a run name without a way to log (no `wandb login`, no WANDB_API_KEY, and
    WANDB_MODE not offline/disabled) is a UserError now, not a prompt or a crash hours later.
    """
    if run == "dummy" or not master_process:
        return DummyWandb()
    import wandb
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode not in ("offline", "disabled", "dryrun") and not _wandb_has_login():
        raise UserError(f"--run={run} logs to wandb, but wandb has no login on this machine: run `wandb login` "
                        f"(or set WANDB_API_KEY), set WANDB_MODE=offline to log locally, or leave --run out")
    return wandb.init(project=project, name=run, config=config)


def _wandb_has_login():
    """An API key in the environment or in ~/.netrc (where `wandb login` writes it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    try:
        hosts = netrc.netrc(os.environ.get("NETRC")).hosts
    except (OSError, netrc.NetrcParseError):
        return False
    base_url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    return urllib.parse.urlsplit(base_url).hostname in hosts


# -----------------------------------------------------------------------------
# The stage


def check_stage_settings(config):
    """The settings every training stage shares, checked right after its config is read (before any work)."""
    if config["resume_from_step"] < -1:
        raise UserError(f"--resume_from_step must be a checkpoint's step, or -1 to start a fresh run, got {config['resume_from_step']}")
    if config["warmup_ratio"] + config["warmdown_ratio"] > 1:
        raise UserError(f"--warmup_ratio + --warmdown_ratio = {config['warmup_ratio'] + config['warmdown_ratio']:g} > 1: "
                        f"the warmup and the warmdown would overlap")


class Stage:
    """
    One run of a training stage: its checkpoint directory (owned for the whole run), where it started from,
    its saves, its metrics file, its wandb run and its end. Attributes after start():
      model, tokenizer, model_tag, checkpoint_dir, start_step (0, or the step resumed from), resumed (bool),
      loop_state (the loop's variables saved with the checkpoint; {} when fresh), data_state (every rank's
      loader state_dict when resumed, else None), parent (the model a fresh run started from), metrics_path.
    """

    def __init__(self, name, config, device):
        if name not in SOURCES:
            raise ValueError(f"unknown stage {name!r}")
        self.name, self.config, self.device = name, config, device
        self.rank = dist.get_rank() if is_distributed() else 0
        self.dry_run = config.get("dry_run", False)  # everything runs, nothing is written
        self.resume_from_step = config["resume_from_step"]
        self.resumed = self.resume_from_step >= 0
        self.wandb = init_wandb(config["run"], self.rank == 0, config, project=WANDB_PROJECTS[name])
        self.last_saved_step, self.data_settings, self.meta = None, None, None

    def start(self, model_tag, model=None, tokenizer=None, source=None, source_step=-1):
        """
        The model this run trains, and its tokenizer. Resumed (--resume_from_step=N): this stage's checkpoint of
        step N in <stage dir>/<model_tag> (the only tag there if model_tag is empty), loaded into `model` if one is
        given (base_train builds it from its settings, which must match), with the tokenizer it was trained with.
        Fresh: `model` and `tokenizer` as given (base_train), or the model of stage `source` (load_model: its tag
        model_tag or the only one, its step source_step or the last) with its own tokenizer. Then the directory
        is claimed (a second run on it is refused) and the metrics file opened.
        """
        if self.resumed:
            own = os.path.join(get_base_dir(), SOURCES[self.name])
            self.model_tag = model_tag or find_model_tag(own, STAGE_COMMANDS[self.name])
            self.checkpoint_dir = checkpoint_dir_for(self.name, self.model_tag)
            self._claim()
            state, self.optimizer_shards, self.meta = load_checkpoint(self.checkpoint_dir, self.resume_from_step,
                                                                     self.device, load_optimizer=True)
            where = self.where()
            tokenizer = tokenizer or checkpoint_tokenizer(self.checkpoint_dir)
            check_tokenizer(self.meta, tokenizer, where)
            if model is None:
                model = model_from_state(state, self.meta, self.device, where)
            else:
                if self.meta["model_config"] != model.config.to_dict():
                    raise UserError(f"{where} has model config {self.meta['model_config']}, this run "
                                    f"{model.config.to_dict()}: resume with the settings of that run (--depth, --max_seq_len)")
                model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state.items()})
            del state
            self.parent, self.loop_state = self.meta.get("parent"), self.meta["loop_state"]
            self.data_state, self.start_step = self.meta.get("data_state"), self.resume_from_step
        else:
            self.parent = None
            if source is not None:
                model, tokenizer, source_meta = load_model(source, self.device, phase="train", model_tag=model_tag or None,
                                                           step=source_step)
                model_tag = source_meta["model_tag"]  # the trained model keeps the tag of the model it started from
                self.parent = dict(source=source, model_tag=model_tag, step=source_meta["step"],
                                   device_batch_size=source_meta.get("user_config", {}).get("device_batch_size"))
            self.model_tag = model_tag
            self.checkpoint_dir = checkpoint_dir_for(self.name, model_tag)
            self._claim()
            self.loop_state, self.data_state, self.start_step = {}, None, 0
        model.train()
        self.model, self.tokenizer = model, tokenizer
        self.metrics_path, self._log_metrics = open_metrics(self.checkpoint_dir, self.start_step,
                                                            enabled=self.rank == 0 and not self.dry_run)
        return model, tokenizer

    def _claim(self):
        if not self.dry_run:  # this run owns the directory until it ends (see claim_checkpoint_dir)
            claim_checkpoint_dir(self.checkpoint_dir, self.resume_from_step, self.config.get("overwrite", False))

    def where(self):
        return f"checkpoint of step {self.resume_from_step} in {self.checkpoint_dir}"

    def resume(self, optimizers, data_settings):
        """
        `data_settings`: what decides which data every step reads (saved with each checkpoint). A resumed run
        must have the same (UserError naming the first difference), and gets back the optimizer state of every
        rank that saved it, re-sharded for this run's ranks.
        """
        self.data_settings = data_settings
        if not self.resumed:
            return
        check_data_settings(self.meta["data_settings"], data_settings, self.where())
        if self.meta["world_size"] != (dist.get_world_size() if is_distributed() else 1):
            print0(f"Resuming a run of {self.meta['world_size']} process(es) on {dist.get_world_size() if is_distributed() else 1}: "
                   f"allowed, every step reads the same data (its settings do not depend on the world size); "
                   f"optimizer state re-sharded")
        load_optimizer_shards(optimizers, self.model, self.optimizer_shards, self.where())
        del self.optimizer_shards
        print0(f"Resumed from step {self.start_step} of {self.checkpoint_dir}")

    def save(self, step, optimizers, data_state=None, **meta):
        """
        Save a checkpoint of step `step` (every rank calls it; nothing is written in a dry run): the weights,
        every rank's optimizer shard, and in the meta file the model and user config, the tokenizer's
        fingerprint, the data settings, every rank's `data_state` (where its data stands) and `meta` (the loop's
        state). A model with non-finite weights is never saved.
        """
        if self.dry_run:
            return
        if not all(torch.isfinite(p).all() for p in self.model.parameters()):
            raise UserError(f"step {step}: the weights are not finite; nothing saved ({self._last_saved()})")
        data_state = gather_from_ranks(data_state) if data_state is not None else None
        if self.rank == 0:
            carry_tokenizer(self.tokenizer, self.checkpoint_dir)  # an imported model's tokenizer goes where it goes
        save_checkpoint(self.checkpoint_dir, step, self.model.state_dict(), optimizer_shard(optimizers, self.model), dict(
            model_config=self.model.config.to_dict(), user_config=self.config, parent=self.parent,
            tokenizer=dict(fingerprint=self.tokenizer.fingerprint(), vocab_size=self.tokenizer.get_vocab_size()),
            data_settings=self.data_settings, data_state=data_state, **meta), rank=self.rank)
        self.last_saved_step = step

    def _last_saved(self):
        step = self.last_saved_step if self.last_saved_step is not None else (self.start_step if self.resumed else None)
        return f"the last checkpoint is step {step}" if step is not None else "no checkpoint was saved"

    def check_finite(self, step, loss, grad_norm, lr_keys):
        """
        Stop at the first non-finite loss or gradient norm: the weights are about to be (or already are) NaN and
        every later step would be garbage. Raised before the next save: no checkpoint newer than the last finite.
        """
        if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
            return
        what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
        raise UserError(f"step {step}: {what} is not finite, training diverged ({self._last_saved()}; nothing newer is "
                        f"saved). The likely knob is the learning rate: lower {', '.join('--' + k for k in lr_keys)} "
                        f"(or raise --warmup_ratio), then resume from the last checkpoint or start again")

    def log_metrics(self, **metrics):
        """One line of <checkpoint dir>/metrics.jsonl (rank 0; the report plots them; a resumed run continues it)."""
        self._log_metrics(**metrics)

    def report(self, section, data):
        """The stage's section of the run report (nothing in a dry run)."""
        if not self.dry_run:
            from nanochat.report import get_report
            get_report().log(section=section, data=data)

    def finish(self, step, stopped_early, next_steps):
        """
        The end of every stage: wandb closed, process group torn down; a stage stopped before its last step or
        before the end of its final evaluations (`stopped_early` on any rank) says how to continue and exits with
        EXIT_STOPPED_EARLY, a finished one prints `next_steps`.
        """
        self.wandb.finish()
        stopped_early, = any_rank(stopped_early)  # rank 0 alone samples: a stop may have cut only its work short
        compute_cleanup()
        if stopped_early:
            print0(f"Stopped at step {step} on request. Continue with the same command plus --resume_from_step={step} "
                   f"(exit code {EXIT_STOPPED_EARLY}: not finished)")
            sys.exit(EXIT_STOPPED_EARLY)
        print0(f"Next: {next_steps}")
