"""
Every training stage's settings and what it does around its loop: start-up, start or resume, log, save, stop, end.

Written once for scripts/base_train, mid_train, chat_sft and chat_rl, with the settings they share (declared here,
below): start (fresh, or resumed from the stage's own checkpoint) with the attention its training steps take, log,
save, stop, end. The loop itself, with its micro-steps, stays written out in each script. The calls a script makes,
on every rank, in order:

    config = configure(globals(), shared=stage_settings())  # its own settings, and the stage's (first)
    stage = Stage("mid", config, source="base", source_step=step, files=dict(conversations=conversations))
    #   the stage's settings checked; made already (--rerun=auto, nanochat/rerun.py): one line says so, exit 0
    device_type, ddp, rank, world_size, device = stage.start_compute()  # wandb on rank 0 unless --run=dummy
    model, tokenizer = stage.start()  # the source's model; resumed: the checkpoint's weights
    optimizers, train_loader = ..., ...
    loop = stage.resume(optimizers, train_loader, data_settings, smooth_train_loss=0.0, epoch_done=False)
    step, stop_now = stage.start_step, False
    while True:
        last_step = ... or stop_now
        if stage.should_save(step, last_step): stage.save(step, optimizers, loop, data_state=...)
        with stage.phase(f"Step {step:05d} | evaluations"):   # evaluate(..., stop=stage.stop): cut short by a stop
            ...; stage.log(step, val_bpb=...)
        if last_step: break
        ... the step and its micro-steps; loop.smooth_train_loss = ...
        stop_now, loop.epoch_done = stage.stop_after_step(loop.epoch_done or train_loader.epoch_done)
        step += 1; stage.log(step, loss=..., lrm=...)
    stage.report("Midtraining", step, [config, {...}])  # the final figures: stage.stopped_early() says if they ran
    sys.exit(stage.finish(step, "python -m scripts.chat_sft"))

Contract: resume() restores a resumed run (optimizer state, the loader's position, checked data settings) and
returns the loop's variables (the keywords: a fresh run's values), which save() stores, so that a resumed run
continues exactly as the uninterrupted one. log() writes one set of names to every sink (wandb, metrics.jsonl).
finish() returns the exit code (speedrun.sh stops at anything but 0): 0 = the stage reached its last step and
ran its final evaluations; EXIT_STOPPED_EARLY = a stop request (SIGTERM, Ctrl-C; on any rank) cut the training,
an evaluation or a sampling short, and a checkpoint to resume from is saved. A user error (one line says what
to do) exits with 1 on its own (nanochat/output.py). Every rank agrees on when to stop and on the exit code.
"""

import contextlib
import json
import math
import os
import signal
import sys
import time
import types
import urllib.parse

import torch
import torch.distributed as dist

from nanochat.attention_kernels import choose_kernel
from nanochat.checkpoint_manager import (SOURCES, check_data_settings, check_model_tag, checkpoint_dir_for,
                                         claim_checkpoint_dir, complete_steps, delete_checkpoint, find_checkpoint_dir,
                                         load_for_resume, load_model, load_optimizer_shards, optimizer_shard,
                                         read_meta, save_checkpoint)
from nanochat.configurator import check_config
from nanochat.files import DiskFull, atomic_write, out_of_space
from nanochat.hardware import autocast_dtype, compute_dtype_line
from nanochat.interrupt import Interrupted
from nanochat.output import UserError, print0, print_banner
from nanochat.processes import autodetect_device_type, compute_cleanup, compute_init
from nanochat.ranks import any_rank, gather_from_ranks, is_distributed
from nanochat.report import get_report
from nanochat.rerun import (RERUN_CHOICES, TRAINING_SECTIONS, checkpoint_input, corpus_input, file_input, fingerprint,
                            tokenizer_input, training_done, training_plan)
from nanochat.tokenizer import carry_tokenizer

EXIT_STOPPED_EARLY = 75  # stopped before the planned last step (SIGTERM / Ctrl-C), a checkpoint saved: resume
#                          with --resume_from_step (75 = EX_TEMPFAIL of sysexits.h, "try again later")

WANDB_PROJECTS = {"base": "nanochat", "mid": "nanochat-mid", "sft": "nanochat-sft", "rl": "nanochat-rl"}

# -----------------------------------------------------------------------------
# The stage's settings, every training stage's: wandb, the device, the checkpoints, saving, resume, rerun. Declared
# here once, as a script declares its own: a training script takes them with configure(globals(),
# shared=stage_settings()), and its --help lists them with these comments (nanochat/configurator.py). Each lowercase
# int / float / bool / str at the top of this module is one. The fingerprint of a stage's outputs leaves out those
# that do not change what it computes (rerun.UNFINGERPRINTED).
run = "dummy"  # wandb run name ("dummy" = no wandb)
device_type = ""  # cuda | cpu | mps; empty = autodetect
model_tag = ""  # the model's name, which names this stage's checkpoint directory (mid_checkpoints/<model_tag>, ...):
#                 base_train: d<depth> if empty; the others: the model they start from (needed only if there are
#                 several), whose name they keep
resume_from_step = -1  # resume from this step's checkpoint in this stage's <model_tag> directory (-1 = start fresh)
overwrite = False  # a fresh run into a model_tag that holds checkpoints of this stage deletes them (default: refuse)
rerun = "no"  # auto (bash speedrun.sh): skip if done from the same settings and inputs, resume if interrupted,
#                replace what other settings made (nanochat/rerun.py); no: a directory with checkpoints is refused
save_every = -1  # steps between checkpoints (<= 0: only the final one)
save_every_minutes = 10.0  # also a checkpoint after this much wall time, replacing the previous such one (-1 = none)
dry_run = False  # run everything but write no checkpoint and no report


def stage_settings(**defaults):
    """
    The stage's settings for configure(globals(), shared=stage_settings()): this module's scope, with `defaults`
    replacing some of their defaults (a stage's own default, given as a value: chat_rl's save_every=60).
    """
    for key, value in defaults.items():
        if type(value) is not type(globals().get(key)):
            raise ValueError(f"stage_settings({key}={value!r}): not a setting of the stage, or not of its type")
    return dict(globals(), **defaults)


class StopRequest:
    """
    Stop a training stage cleanly on SIGTERM (a scheduler's "your time is up", `kill`) or SIGINT (Ctrl-C), within
    seconds, in any phase: a training step finishes; an evaluation or sampling stops at once (the phases take
    `stop=stage.stop` and ask it between items: nanochat.interrupt.Interrupted); then a checkpoint is saved (one
    already saved stays as it is) and the stage exits with EXIT_STOPPED_EARLY. A second signal kills at once.
    The handlers are installed by listen() (Stage.resume: before it there is nothing to save, a signal kills).

    A signal may reach the ranks at different moments, or only one of them. At the end of a step the ranks combine
    their `requested` flags (Stage.stop_after_step) and all stop together. Within a phase, stop() is True once this
    rank got a signal or, under torchrun, once another rank did: the first to ask after its signal writes it into
    the process group's store, where the others look (at most every STORE_EVERY seconds), so that no rank goes on
    with a long evaluation while the others wait for it. `seen`: a True answer was given (a phase or the training
    was cut short): the stage stopped early.
    """

    STORE_KEY = "nanochat_stop_requested"
    STORE_EVERY = 0.5  # seconds

    def __init__(self, rank):
        self.rank = rank
        self.requested = False
        self.seen = False
        self._store = self._last_look = None
        if is_distributed():
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except (AttributeError, RuntimeError):  # a torch without it: the ranks still agree at each step's end
                pass
        self._posted = False

    def listen(self):
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        # Python runs a handler between two bytecodes of the main thread, possibly in the middle of a print: a
        # print here would re-enter the busy stdout buffer ("RuntimeError: reentrant call"), and the run would die
        # with a traceback. So the handler only records the request and says so with one os.write, a system call
        # that touches no Python buffer (on stderr, which a log shows unbuffered).
        self.requested = True
        signal.signal(signum, signal.SIG_DFL)
        message = (f"[rank {self.rank}] got {signal.Signals(signum).name}: stopping (a training step finishes, an "
                   f"evaluation or sampling stops now), then saving a checkpoint (send it again to quit at once)\n")
        try:
            os.write(2, message.encode())
        except OSError:  # stderr closed or full: the request is recorded all the same
            pass

    def __call__(self):
        """True once a stop was requested of this run, here or (under torchrun) on another rank."""
        if self._store is not None and self.requested and not self._posted:
            # here, not in the signal handler: a store call must not interrupt another one
            self._store.set(self.STORE_KEY, "1")
            self._posted = True
        elif self._store is not None and not self.requested:
            now = time.monotonic()
            if self._last_look is None or now - self._last_look >= self.STORE_EVERY:
                self._last_look = now
                self.requested = self._store.check([self.STORE_KEY])
        self.seen = self.seen or self.requested
        return self.requested


# -----------------------------------------------------------------------------
# Experiment tracking: a wandb run on the master process (or a stand-in that logs nothing), and the run's metrics file


class DummyWandb:
    """Stands in for a wandb run when tracking is off (run name "dummy", or a rank other than 0)."""

    def log(self, *args, **kwargs):
        pass

    def finish(self):
        pass


def init_wandb(run, master_process, config, project):
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


def open_metrics(checkpoint_dir, start_step, enabled=True):
    """
    The run's per-step metrics, one JSON line per step in <checkpoint_dir>/metrics.jsonl (the report plots
    them). A fresh run starts the file empty; a resumed run continues its curve: it keeps the train lines of
    steps up to its start step and the evaluations before it (it evaluates its start step again), dropping
    what the earlier run logged later. Returns (path, log) with log(**metrics) appending a line (rank 0 only:
    pass enabled=False elsewhere).
    """
    path = os.path.join(checkpoint_dir, "metrics.jsonl")
    if enabled:
        kept = []
        if start_step > 0 and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError:  # a line cut short when the earlier run was killed
                        continue
                    if r["step"] < start_step or (r["step"] == start_step and "val_bpb" not in r):
                        kept.append(line)
        with atomic_write(path, "w") as f:
            f.writelines(kept)

    def log(**metrics):
        if enabled:
            try:
                with open(path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(metrics) + "\n")
            except OSError as e:  # a full disk: one line, as for a checkpoint
                if out_of_space(e) is None:
                    raise
                raise DiskFull(out_of_space(e), "metrics.jsonl", checkpoint_dir) from None
    return path, log


# -----------------------------------------------------------------------------
# The stage


def check_stage_settings(config):
    """
    The stage's settings, and the schedule every training stage has, checked before any work (Stage() does it
    first): a bad value is refused with one line.
    """
    check_config(config, choices={"device_type": ("", "cuda", "cpu", "mps"), "rerun": RERUN_CHOICES})
    if config["resume_from_step"] < -1:
        raise UserError(f"--resume_from_step must be a checkpoint's step, or -1 to start a fresh run, "
                        f"got {config['resume_from_step']}")
    warm = config["warmup_ratio"] + config["warmdown_ratio"]
    if warm > 1:
        raise UserError(f"--warmup_ratio + --warmdown_ratio = {warm:g} > 1: the warmup and the warmdown would overlap")
    if config["model_tag"]:
        check_model_tag(config["model_tag"])
    minutes = config["save_every_minutes"]
    if not (minutes > 0 or minutes == -1):
        raise UserError(f"--save_every_minutes must be > 0, or -1 for none, got {minutes!r}")


class Stage:
    """
    One run of a training stage: what it is made from, its checkpoint directory (owned for the whole run), where it
    started from, its saves, its metrics, its stop request and its end.
    Made before any work, on every rank: its settings are checked (check_stage_settings), and what it reads makes, with
    its settings, its fingerprint `made_from` (nanochat/rerun.py), kept with every checkpoint and in its report
    section. With --rerun=auto a stage made already from them says so in one line and exits 0 here; otherwise
    start_compute() decides, on rank 0 for every rank: resume from its last checkpoint made from the same fingerprint,
    or replace checkpoints made otherwise, or start fresh.
    Attributes after start_compute(): device, rank, `stop` (the StopRequest). After start(): model, tokenizer,
    model_tag, checkpoint_dir, start_step (0, or the step resumed from), resumed (bool), parent (the model a fresh run
    started from), metrics_path.
    """

    def __init__(self, name, config, model_tag=None, source=None, source_step=-1, files=None):
        """
        `config`: the script's, with the stage's settings. What the stage reads: the model of stage `source` (its
        --model_tag or the only one, at step `source_step` or its last), or (base_train, no source) the tokenizer and
        the corpus; and `files` ({name: path}, the files of its settings). `model_tag`: the name of the model it
        writes where the script decides it (base_train's d<depth>); else --model_tag's, the source model's.
        """
        if name not in SOURCES:
            raise ValueError(f"unknown stage {name!r}")
        check_stage_settings(config)
        self.name = name
        self.config = config
        self.source = source
        self.source_step = source_step
        self.dry_run = config["dry_run"]  # everything runs, nothing is written
        self.resume_from_step = config["resume_from_step"]
        self.resumed = self.resume_from_step >= 0
        self.overwrite = config["overwrite"]
        self._model_tag = config["model_tag"] if model_tag is None else model_tag
        inputs = (dict(source=checkpoint_input(source, self._model_tag, source_step)) if source is not None else
                  dict(tokenizer=tokenizer_input(), corpus=corpus_input()))
        inputs.update({key: file_input(path) for key, path in (files or {}).items()})
        self.made_from = fingerprint(name, config, inputs)
        # --rerun=auto decides what to do with the checkpoint directory of the model this run writes
        self._planned_tag = inputs["source"]["model_tag"] if source is not None else self._model_tag
        # no source model yet: nothing can have been made from it; the run goes on to say what is missing
        self._rerun = (config["rerun"] == "auto" and not self.resumed and not self.overwrite
                       and (source is None or inputs["source"]["step"] is not None))
        if self._rerun and training_done(name, self._planned_tag, self.made_from):
            sys.exit(0)
        self.last_saved_step = None
        self.data_settings = None
        self.meta = None
        self._stopped_early = None
        self.save_every = config["save_every"]
        # saves every save_every_minutes of wall time; each replaces the one before it (its meta's save_kind is
        # "periodic", set by should_save: save() deletes the earlier ones so marked)
        self.save_every_minutes = config["save_every_minutes"]
        self.save_due = False
        self._save_kind = "kept"

    def start_compute(self):
        """
        The start of the stage's work on every rank: the banner, the process group and this rank's device
        (compute_init: one process per device under torchrun; --device_type "" = autodetect) and the compute dtype
        decided for it; with --rerun=auto, what this run does with its checkpoint directory; the stop request, and
        the wandb run (rank 0, unless --run=dummy). Returns (device_type, ddp, rank, world_size, device).
        """
        print_banner()
        device_type = self.config["device_type"] or autodetect_device_type()
        ddp, self.rank, _, world_size, self.device = compute_init(device_type)  # _: the local rank, which chose the GPU
        print0(compute_dtype_line(device_type))
        if self._rerun:
            self._plan()
        self.stop = StopRequest(self.rank)
        self._last_save_time = time.monotonic()
        self.wandb = init_wandb(self.config["run"], self.rank == 0, self.config, project=WANDB_PROJECTS[self.name])
        return device_type, ddp, self.rank, world_size, self.device

    def _plan(self):
        """--rerun=auto: what this run does with what its checkpoint directory holds (rerun.training_plan)."""
        checkpoint_dir = checkpoint_dir_for(self.name, self._planned_tag)
        section = TRAINING_SECTIONS[self.name]
        plan = [training_plan(section, checkpoint_dir, self.made_from) if self.rank == 0 else None]
        if is_distributed():  # rank 0's decision for every rank: they must all skip, resume or start alike
            dist.broadcast_object_list(plan, src=0)
        what, steps = plan[0]
        if what in ("done", "resume"):  # done: only its report section was written since the check; written again
            self.resume_from_step = steps
            self.resumed = True
            self.overwrite = True  # the interrupted run's incomplete later files go (claim_checkpoint_dir names them)
            print0(f"{section}: resuming from step {steps} of {checkpoint_dir}, an interrupted run of the "
                   f"same settings and inputs (--rerun=auto)")
        elif what == "replace":
            self.overwrite = True  # claim_checkpoint_dir names what it deletes
            shown = ", ".join(map(str, steps)) or "incomplete ones"
            print0(f"{section}: {checkpoint_dir} holds checkpoints (steps {shown}) made from other "
                   f"settings or inputs: they are replaced (--rerun=auto)")

    def start(self, model=None, tokenizer=None, attention="auto"):
        """
        The model this run trains, and its tokenizer. Resumed (--resume_from_step=N): this stage's checkpoint of
        step N in <stage dir>/<model_tag> (the only tag there if model_tag is empty), loaded into `model` if one is
        given (base_train builds it from its settings, which must match), with the tokenizer it was trained with.
        Fresh: `model` and `tokenizer` as given (base_train), or the model of stage `source` (load_model: its tag
        model_tag or the only one, its step source_step or the last) with its own tokenizer. Then the directory
        is claimed (a second run on it is refused) and the metrics file opened. The model attends with the kernel
        `attention` names (base_train --attention; "auto" in the other stages: attention_kernels.choose_kernel,
        rank 0's choice for every rank), said on the line "Attention in training steps: ...".
        """
        model_tag, source, source_step = self._model_tag, self.source, self.source_step
        if self.resumed:
            self.model_tag, self.checkpoint_dir = find_checkpoint_dir(self.name, model_tag)
            self._claim()
            model, tokenizer, self.optimizer_shards, self.meta = load_for_resume(
                self.checkpoint_dir, self.resume_from_step, self.device, model, tokenizer)
            self.parent = self.meta.get("parent")
            self.start_step = self.resume_from_step
        else:
            self.parent = None
            if source is not None:
                model, tokenizer, source_meta = load_model(source, self.device, phase="train",
                                                           model_tag=model_tag or None, step=source_step)
                model_tag = source_meta["model_tag"]  # the trained model keeps the tag of the model it started from
                self.parent = dict(source=source, model_tag=model_tag, step=source_meta["step"],
                                   device_batch_size=source_meta.get("user_config", {}).get("device_batch_size"))
            self.model_tag = model_tag
            self.checkpoint_dir = checkpoint_dir_for(self.name, model_tag)
            self._claim()
            self.start_step = 0
        model.train()
        device_type = torch.device(self.device).type
        decision = [choose_kernel(attention, model.config, device_type, autocast_dtype(device_type))
                    if self.rank == 0 else None]
        if is_distributed():  # rank 0's for every rank, as the compute dtype: the same kernels, the same numbers
            dist.broadcast_object_list(decision, src=0)
        model.attention_kernel, why = decision[0]
        print0(why)
        self.model = model
        self.tokenizer = tokenizer
        self.metrics_path, self._log_metrics = open_metrics(self.checkpoint_dir, self.start_step,
                                                            enabled=self.rank == 0 and not self.dry_run)
        return model, tokenizer

    def _claim(self):
        if not self.dry_run:  # this run owns the directory until it ends (see claim_checkpoint_dir)
            claim_checkpoint_dir(self.checkpoint_dir, self.resume_from_step, self.overwrite)

    def where(self):
        return f"checkpoint of step {self.resume_from_step} in {self.checkpoint_dir}"

    def resume(self, optimizers, train_loader, data_settings, **loop):
        """
        Ready to train: called once everything is built, on every rank. `data_settings`: what decides which data
        every step reads (saved with each checkpoint). `loop`: the training loop's variables with their values for
        a fresh run. A resumed run must have the checkpoint's data settings (UserError naming the first difference)
        and gets back every rank's optimizer state (re-sharded for this run's ranks) and its data position
        (train_loader.load_state_dict; no loader: the data of a step follows from the step). Returns the loop's
        variables as a namespace (loop.smooth_train_loss, ...): a resumed run's from its checkpoint (a variable the
        checkpoint lacks keeps its fresh value); save() stores them. From here on a signal stops the stage cleanly.
        """
        self.data_settings = data_settings
        if self.resumed:
            check_data_settings(self.meta["data_settings"], data_settings, self.where())
            world_size = dist.get_world_size() if is_distributed() else 1
            if self.meta["world_size"] != world_size:
                print0(f"Resuming a run of {self.meta['world_size']} process(es) on {world_size}: allowed, "
                       f"every step reads the same data (its settings do not depend on the world size); "
                       f"optimizer state re-sharded")
            load_optimizer_shards(optimizers, self.model, self.optimizer_shards, self.where())
            del self.optimizer_shards
            if train_loader is not None:
                train_loader.load_state_dict(self.meta.get("data_state"))
            saved = self.meta["loop_state"]
            loop = {k: saved.get(k, v) for k, v in loop.items()}
            print0(f"Resumed from step {self.start_step} of {self.checkpoint_dir}")
        self.stop.listen()
        return types.SimpleNamespace(**loop)

    def save(self, step, optimizers, loop, data_state=None, **meta):
        """
        Save a checkpoint of step `step` (every rank calls it; nothing is written in a dry run): the weights,
        every rank's optimizer shard, and in the meta file the model and user config, the tokenizer's
        fingerprint, the data settings, every rank's `data_state` (where its data stands), the loop's variables
        (`loop`, the namespace resume() returned) and `meta`. A model with non-finite weights is never saved.
        """
        if self.dry_run:
            return
        if not all(torch.isfinite(p).all() for p in self.model.parameters()):
            raise UserError(f"step {step}: the weights are not finite; nothing saved ({self._last_saved()})")
        data_state = gather_from_ranks(data_state) if data_state is not None else None
        full = None
        if self.rank == 0:
            try:
                carry_tokenizer(self.tokenizer, self.checkpoint_dir)  # an imported model's tokenizer goes where it goes
            except DiskFull as e:
                full = e
        if any_rank(full is not None)[0]:  # every rank ends with the line, none waits for rank 0 in the save
            raise full or UserError(f"rank 0 could not write the tokenizer into {self.checkpoint_dir} (no space "
                                    f"left): nothing of step {step} was saved")
        tokenizer = dict(fingerprint=self.tokenizer.fingerprint(), vocab_size=self.tokenizer.get_vocab_size())
        checkpoint_meta = dict(model_config=self.model.config.to_dict(), user_config=self.config, parent=self.parent,
                               tokenizer=tokenizer, data_settings=self.data_settings, data_state=data_state,
                               loop_state=vars(loop), made_from=self.made_from, save_kind=self._save_kind, **meta)
        save_checkpoint(self.checkpoint_dir, step, self.model.state_dict(), optimizer_shard(optimizers, self.model),
                        checkpoint_meta, rank=self.rank)
        self.last_saved_step = step
        self.save_due = False
        self._last_save_time = time.monotonic()
        if self.rank == 0:  # a periodic save was only ever a place to resume from: the newer one replaces it
            for earlier in complete_steps(self.checkpoint_dir):
                if earlier < step and read_meta(self.checkpoint_dir, earlier).get("save_kind") == "periodic":
                    delete_checkpoint(self.checkpoint_dir, earlier)

    def should_save(self, step, last_step):
        """
        Whether the loop saves at the top of step `step` (the same answer on every rank): at the last step (before
        the final evaluations, so a crash in them loses nothing), every --save_every steps, and when
        --save_every_minutes of wall time have passed since the last save (a periodic save, which the next save
        replaces, as it replaces the save of a run stopped early: at most that much work is lost to a kill -9).
        """
        every = self.save_every > 0 and step > self.start_step and step % self.save_every == 0
        due = self.save_due and step > self.start_step
        # the last step of a run stopped early is only a place to resume from, as a periodic save is
        kept = every or (last_step and not self.stop.requested)
        self._save_kind = "kept" if kept else "periodic"
        return last_step or every or due

    def _last_saved(self):
        step = self.last_saved_step
        if step is None and self.resumed:
            step = self.start_step
        return f"the last checkpoint is step {step}" if step is not None else "no checkpoint was saved"

    def log(self, step, **metrics):
        """
        The metrics of step `step`, under the same names in every sink: the wandb run (rank 0, unless --run=dummy)
        and a line of <checkpoint dir>/metrics.jsonl (rank 0, not in a dry run; the report plots it; a resumed run
        continues it). A non-finite `step_loss` or `grad_norm` stops the run here (UserError), before the next save:
        the weights are about to be (or are) NaN, every later step would be garbage, and no checkpoint newer than
        the last finite one is written.
        """
        self.wandb.log(dict(step=step, **metrics))
        self._log_metrics(step=step, **metrics)
        for name in ("step_loss", "grad_norm"):
            value = metrics.get(name)
            if value is not None and not math.isfinite(value):
                lr_keys = [f"--{k}" for k in self.config if k.endswith("_lr") or k == "init_lr_frac"]
                raise UserError(f"step {step}: {name.replace('_', ' ')} {value} is not finite, training diverged "
                                f"({self._last_saved()}; nothing newer is saved). The likely knob is the learning "
                                f"rate: lower {', '.join(lr_keys)} (or raise --warmup_ratio), then resume from the "
                                f"last checkpoint or start again")

    @contextlib.contextmanager
    def phase(self, what):
        """
        `with stage.phase(f"Step {step:05d} | evaluations"):` an evaluation or sampling phase that a stop request
        ends where it is: its parts ask stage.stop and raise Interrupted (on every rank together where they use
        collectives); the block ends there and says so, and the stage has stopped early (stopped_early).
        """
        try:
            yield
        except Interrupted:
            print0(f"{what} stopped: a stop was requested")

    def stop_after_step(self, *flags):
        """
        At the end of a training step, on every rank: (stop, *flags), `stop` True if a stop was requested of any
        rank, each flag True if it is True on any rank (one all_reduce). A stop here ends the training early.
        """
        minutes = (time.monotonic() - self._last_save_time) / 60
        due = self.rank == 0 and 0 < self.save_every_minutes <= minutes  # rank 0's clock, for every rank
        stop, self.save_due, *flags = any_rank(self.stop.requested, due, *flags)
        if stop:
            self.stop.requested = self.stop.seen = True  # every rank's phases now stop at once too
        return (stop, *flags)

    def stopped_early(self):
        """
        After the loop, on every rank (one all_reduce, the first time): True if a stop request cut the training
        or an evaluation or sampling short on any rank (rank 0 alone samples: a stop may have cut only its work
        short). A stop that came after the last of them did not: the stage finished.
        """
        if self._stopped_early is None:
            self._stopped_early, = any_rank(self.stop.seen)
        return self._stopped_early

    def report(self, section, step, data):
        """
        The stage's section of the run report (every rank calls it; nothing is written in a dry run): `data` (the
        config, then what the stage measured), then what every stage reports: the steps run, whether it stopped
        early, its world size and its metrics file (the report plots it).
        """
        common = {"Steps run": step, "Stopped early": self.stopped_early(),
                  "World size": dist.get_world_size() if is_distributed() else 1, "Metrics file": self.metrics_path}
        if not self.dry_run:
            get_report().log(section=section, data=[*data, common], made_from=self.made_from)

    def finish(self, step, next_steps):
        """
        The end of every stage, on every rank: wandb closed, process group torn down. Returns the exit code:
        EXIT_STOPPED_EARLY when stopped early (stopped_early(); it says how to continue), else 0 (it prints
        `next_steps`).
        """
        stopped_early = self.stopped_early()
        self.wandb.finish()
        compute_cleanup()
        if stopped_early:
            how = ("Run the same command again to continue from there (--rerun=auto resumes it)"
                   if self.config["rerun"] == "auto" else
                   f"Continue with the same command plus --resume_from_step={step}")
            print0(f"Stopped at step {step} on request. {how} (exit code {EXIT_STOPPED_EARLY}: not finished)")
            return EXIT_STOPPED_EARLY
        print0(f"Next: {next_steps}")
        return 0
