"""Learning-rate schedule (Megatron's OptimizerParamScheduler, counted in iterations)."""

import math

from ..optimizer.optimizer_state import pick_hyperparameter


def check_schedule(lr_warmup_steps: int, lr_decay_steps: int, lr_decay_style: str):
    """Raise ValueError unless 0 <= lr_warmup_steps <= lr_decay_steps, lr_decay_steps > 0 and the decay style
    is known."""
    if lr_decay_style not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr_decay_style must be constant, linear or cosine, got {lr_decay_style!r}")
    if lr_decay_steps <= 0:  # the decay would be over before the first step: every step at min_lr (Megatron asserts)
        raise ValueError(f"lr_decay_steps must be > 0, got {lr_decay_steps}")
    if not 0 <= lr_warmup_steps <= lr_decay_steps:
        raise ValueError(f"lr_warmup_steps ({lr_warmup_steps}) must be in [0, lr_decay_steps ({lr_decay_steps})]")


class OptimizerParamScheduler:
    """Linear warmup from 0 to `max_lr`, then constant / linear / cosine decay to `min_lr`.

    Like Megatron, the scheduler is stepped after each optimizer step and sets every param group's
    'lr' (times the group's 'lr_mult'). Iteration 0 of a warmup runs with lr 0.

    Args:
        optimizer: anything with `param_groups` (a MegatronOptimizer or a torch optimizer).
        max_lr, min_lr: peak and floor.
        lr_warmup_steps: iterations of linear warmup.
        lr_decay_steps: iteration at which decay reaches min_lr (>= lr_warmup_steps).
        lr_decay_style: 'constant', 'linear' or 'cosine'.
    """

    def __init__(self, optimizer, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style):
        check_schedule(lr_warmup_steps, lr_decay_steps, lr_decay_style)
        self.optimizer = optimizer
        self.max_lr, self.min_lr = float(max_lr), float(min_lr)
        self.lr_warmup_steps, self.lr_decay_steps = int(lr_warmup_steps), int(lr_decay_steps)
        self.lr_decay_style = lr_decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        n = self.num_steps
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.max_lr * n / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return self.max_lr
        if n > self.lr_decay_steps:
            return self.min_lr
        span = self.lr_decay_steps - self.lr_warmup_steps
        ratio = (n - self.lr_warmup_steps) / span if span > 0 else 1.0
        coeff = 1.0 - ratio if self.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1):
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def state_dict(self):
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "lr_warmup_steps": self.lr_warmup_steps,
                "lr_decay_steps": self.lr_decay_steps, "lr_decay_style": self.lr_decay_style,
                "num_steps": self.num_steps}

    def load_state_dict(self, state, hyperparameters: str = "check"):
        """Restore the position; the schedule's shape stored with it meets this run's per
        `hyperparameters` ('check': must be equal, 'override': this run's, 'checkpoint': the checkpoint's)."""
        for key in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style"):
            setattr(self, key, pick_hyperparameter(f"learning-rate schedule {key}", getattr(self, key), state[key],
                                                   hyperparameters))
        self.num_steps = int(state["num_steps"])
        self.step(0)
