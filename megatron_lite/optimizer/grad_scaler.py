"""Loss scaling for fp16 training: constant, or dynamic with growth, back-off and hysteresis.

Every rank feeds the same `found_inf` (agreed by an all-reduce in the optimizer), so every rank makes the
same scaling decisions and stays bitwise in step.
"""

from .optimizer_config import OptimizerConfig


class ConstantGradScaler:
    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool):
        pass

    def state_dict(self):
        return {"scale": self.scale}

    def load_state_dict(self, state_dict):
        self.scale = float(state_dict["scale"])


class DynamicGradScaler(ConstantGradScaler):
    """Double the scale after `growth_interval` clean steps; after `hysteresis` overflowing steps (not
    necessarily consecutive) halve it, never below `min_scale`.

    Args:
        initial_scale, min_scale: starting scale and floor.
        growth_factor, backoff_factor: multipliers on growth (2.0) and back-off (0.5).
        growth_interval: clean steps between growths (Megatron's loss_scale_window).
        hysteresis: overflows tolerated before backing off; reset to this value on growth.
    """

    def __init__(self, initial_scale, min_scale, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=1000, hysteresis=2):
        super().__init__(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self):
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict):
        self.scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict.get("growth_tracker", 0))
        self._hysteresis_tracker = int(state_dict.get("hysteresis_tracker", self.hysteresis))


def make_grad_scaler(config: OptimizerConfig):
    """Megatron's choice: a constant scale when one is given (fp16 or bf16), dynamic scaling for fp16."""
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if not config.fp16:
        return None
    return DynamicGradScaler(
        initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
        growth_interval=config.loss_scale_window, hysteresis=config.hysteresis,
    )
