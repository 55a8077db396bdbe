"""The two non-sharded optimizers: every rank holds full fp32 main params and the whole optimizer state.

FP32Optimizer steps the model's fp32 parameters themselves (grad = main_grad, an alias);
Float16OptimizerWithFloat16Params keeps fp32 main copies of fp16/bf16 parameters and casts them back.
"""

from typing import Optional

import torch

from .optimizer import (STATE_KEYS, MegatronOptimizer, copy_main_to_model, copy_model_to_main, main_param,
                        qualified_param_names)


class _FullParamOptimizer(MegatronOptimizer):
    """Every rank holds full main params: `main_for[model_param]` is the tensor the inner optimizer steps.

    Args:
        make_inner: callable(list of param-group dicts over main params) -> inner torch optimizer.
        config, model_chunks, grad_scaler: as MegatronOptimizer.
        model_param_groups: param-group dicts over *model* params (weight-decay split etc.).
    """

    def __init__(self, make_inner, config, model_chunks, model_param_groups, grad_scaler):
        # Registration order, as torch's clip_grad_norm_ sees the parameters (bit-exact norms).
        self.main_for = {p: main_param(p) for p in qualified_param_names(model_chunks)}
        groups = [{**g, "params": [self.main_for[p] for p in g["params"]]} for g in model_param_groups]
        super().__init__(make_inner(groups), config, model_chunks, grad_scaler)

    def _copy_model_grads_to_main_grads(self):
        skipped = self._skipped()
        for model_param, main in self.main_for.items():
            # fp32 main_grad: .float() is the same tensor
            main.grad = None if model_param in skipped else model_param.main_grad.float()
        return [main.grad for main in self.main_for.values() if main.grad is not None]

    def _grads_for_stats(self, main_grads):
        """Dense gradients are the same on every rank: counted locally. Expert gradients are the same only
        within an expert data-parallel group: rank 0 of each group counts them, summed over all ranks."""
        if not self.has_expert_params:
            return main_grads, None
        dense = [m.grad for p, m in self.main_for.items() if m.grad is not None and p not in self.expert_params]
        expert = [m.grad for p, m in self.main_for.items() if m.grad is not None and p in self.expert_params]
        return dense, expert if self._counts_expert_grads else []

    def _copy_main_params_to_model_params(self):
        for model_param, main in self.main_for.items():
            copy_main_to_model(main, model_param.data)

    def _copy_model_params_to_main_params(self):
        for model_param, main in self.main_for.items():
            copy_model_to_main(model_param.data, main)

    def local_chunks(self, rank: Optional[int] = None):
        # Every rank steps every parameter, whole.
        return [(self.param_to_name[p], 0, p.numel(), None if rank is not None else main)
                for p, main in self.main_for.items()]

    def _full_main_state(self):
        out = {}
        for model_param, main in self.main_for.items():
            state = self._state_of(main)
            entry = {"param": main.detach().float().cpu().clone()}
            entry.update({k: state[k].detach().float().cpu().clone()
                          for k in STATE_KEYS[self.config.optimizer] if k in state})
            entry["step"] = int(state["step"].item()) if "step" in state else 0
            out[self.param_to_name[model_param]] = entry
        for entry in out.values():  # a parameter that skipped every step so far: torch's initial state
            if self.update_count and len(entry) == 2:
                entry.update({k: torch.zeros_like(entry["param"]) for k in STATE_KEYS[self.config.optimizer]})
        return out

    def _load_full_main_state(self, state):
        for model_param, main in self.main_for.items():
            entry = state[self.param_to_name[model_param]]
            if tuple(entry["param"].shape) != tuple(main.shape):
                raise ValueError(f"shape mismatch for {self.param_to_name[model_param]}")
            main.data.copy_(entry["param"])
            tensors = {k: entry[k] for k in STATE_KEYS[self.config.optimizer] if k in entry}
            self._set_state_of(main, entry.get("step"), tensors)
        self.update_count = max([int(e.get("step", 0)) for e in state.values()] + [0])
        self._copy_main_params_to_model_params()


class FP32Optimizer(_FullParamOptimizer):
    """fp32 params: the inner optimizer steps the model params themselves, with grad = main_grad (an alias)."""


class Float16OptimizerWithFloat16Params(_FullParamOptimizer):
    """fp16/bf16 params with full fp32 main copies held by the inner optimizer; step() casts them back."""
