"""
Learning-rate and momentum schedules of the training scripts, as plain functions of the step.
The scripts apply them every step: group["lr"] = group["initial_lr"] * multiplier.
"""


def lr_multiplier(step, num_iterations, warmup_ratio=0.0, warmdown_ratio=0.2, final_lr_frac=0.0):
    """
    Warmup, constant, warmdown ("trapezoid"):
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
    """
    frac = min(step / warmup_steps, 1.0)
    return (1 - frac) * start + frac * end


def mid_lr_multiplier(progress, warmdown_frac=0.2):
    """
    Midtraining's schedule as a function of progress through the run (0..1): constant 1, then a linear
    decay to 0 over the last `warmdown_frac`. Progress, not steps, because a run of one epoch of the
    mixture does not know its number of steps in advance (progress = fraction of the data read).
    """
    if progress < 1 - warmdown_frac:
        return 1.0
    return max(0.0, (1 - progress) / warmdown_frac)
