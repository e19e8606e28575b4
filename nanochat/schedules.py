"""
Learning-rate and momentum schedules of the training stages, as plain functions, and the two loops that apply
them to the optimizers. Every stage uses the same schedule with its own defaults for its settings
(warmup_ratio, warmdown_ratio, final_lr_frac): pretraining and midtraining decay over their last 20%,
SFT and RL over the whole run (warmdown_ratio=1: a linear decay from the first step to 0).
"""


def lr_multiplier(step, num_iterations, warmup_ratio=0.0, warmdown_ratio=0.2, final_lr_frac=0.0):
    """
    Warmup, constant, warmdown ("trapezoid"), where the run is `num_iterations` steps long and `step` of them
    are done. A run of one epoch of data, whose number of steps is not known in advance, passes how far it is
    in another unit: conversations read so far out of the epoch's conversations.
    - warmup: the first round(warmup_ratio * num_iterations) steps ramp linearly up to 1 (step 0 gets
      1/warmup); early gradients are large and noisy, and Adam's moment estimates are not settled yet.
    - constant at 1 in the middle: most of the progress happens at the full learning rate.
    - warmdown: the last round(warmdown_ratio * num_iterations) steps decay linearly to final_lr_frac,
      reached at step == num_iterations. Annealing the noise away at the end lowers the final loss.
    """
    warmup = round(warmup_ratio * num_iterations)
    warmdown = round(warmdown_ratio * num_iterations)
    if step < warmup:
        return (step + 1) / warmup
    if step <= num_iterations - warmdown:
        return 1.0
    progress = (num_iterations - step) / warmdown  # 1 at the start of the warmdown, 0 at the end
    return progress + (1 - progress) * final_lr_frac


def muon_momentum(step, warmup_steps=300, start=0.85, end=0.95):
    """
    Muon's momentum ramps from 0.85 to 0.95 over the first 300 steps. A high momentum averages the
    gradient over ~1/(1-0.95) = 20 steps: smooth, but slow to react, which hurts while the weights are
    still changing fast at the start. 0.85 (~7 steps) reacts faster early; later the extra smoothing helps.
    Every stage builds new optimizers (their momentum buffers start at zero), so every stage ramps it.
    """
    frac = min(step / warmup_steps, 1.0)
    return (1 - frac) * start + frac * end


def scale_initial_lrs(optimizers, init_lr_frac):
    """Finetuning stages start from a fraction of the pretraining learning rates: every group's lr times it."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] = group["lr"] * init_lr_frac


def set_learning_rates(optimizers, multiplier, muon_momentum_now):
    """This step's learning rate of every group (initial_lr x multiplier), and Muon's momentum."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
            if "momentum" in group:  # Muon's groups (AdamW's have betas instead)
                group["momentum"] = muon_momentum_now
