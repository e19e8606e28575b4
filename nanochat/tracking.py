"""
Experiment tracking: a wandb run on the master process, or a stand-in that logs nothing.
"""

import os
import urllib.parse

from nanochat.common import UserError


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

