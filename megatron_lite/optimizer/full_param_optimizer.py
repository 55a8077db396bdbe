"""The two non-sharded optimizers: every rank holds full fp32 main params and the whole optimizer state.

FP32Optimizer steps the model's fp32 parameters themselves (grad = main_grad, an alias);
Float16OptimizerWithFloat16Params keeps fp32 main copies of fp16/bf16 parameters and casts them back.
"""

from .main_params import copy_main_to_model, copy_model_to_main, main_params
from .optimizer import MegatronOptimizer, qualified_param_names
from .optimizer_state import MainShard


class _FullParamOptimizer(MegatronOptimizer):
    """Every rank holds full main params: `main_of[model_param]` is the tensor the inner optimizer steps.

    Args:
        make_inner: callable(list of param-group dicts over main params) -> inner torch optimizer.
        config, model_chunks, grad_scaler: as MegatronOptimizer.
        model_param_groups: param-group dicts over *model* params (weight-decay split etc.).
    """

    def __init__(self, make_inner, config, model_chunks, model_param_groups, grad_scaler):
        # Registration order, as torch's clip_grad_norm_ sees the parameters (bit-exact norms).
        params = list(qualified_param_names(model_chunks))
        self.main_of = dict(zip(params, main_params(params, config)))
        self._step_grads = {}  # model param -> its fp32 gradient of this step (on the model's device)
        groups = [{**g, "params": [self.main_of[p] for p in g["params"]]} for g in model_param_groups]
        main_shards = [MainShard(p, 0, p.numel(), main) for p, main in self.main_of.items()]  # every one whole
        super().__init__(make_inner(groups), config, model_chunks, grad_scaler, main_shards)

    def _copy_model_grads_to_main_grads(self):
        skipped, self._step_grads = self._skipped(), {}
        for model_param, main in self.main_of.items():
            if model_param in skipped:
                main.grad = None
            else:  # fp32 main_grad: .float() is the same tensor
                self._step_grads[model_param] = self._set_main_grad(main, model_param.main_grad.float())
        return list(self._step_grads.values())

    def _grads_for_stats(self, main_grads):
        """Dense gradients are the same on every rank: counted locally. Expert gradients are the same only
        within an expert data-parallel group: rank 0 of each group counts them, summed over all ranks."""
        if not self.has_expert_params:
            return main_grads, None
        dense = [g for p, g in self._step_grads.items() if p not in self.expert_params]
        expert = [g for p, g in self._step_grads.items() if p in self.expert_params]
        return dense, expert if self._counts_expert_grads else []

    def _copy_main_params_to_model_params(self):
        for model_param, main in self.main_of.items():
            copy_main_to_model(main, model_param.data)

    def _copy_model_params_to_main_params(self, values=None):
        for model_param, main in self.main_of.items():
            if values is None:
                copy_model_to_main(model_param.data, main)
            else:  # also into an fp32 main param that is the model's own tensor
                main.data.copy_(values[model_param].reshape(main.shape))

    def _gathered(self, state):
        """Every rank holds every parameter whole: its shards are the state dict's entries."""
        out = {}
        for shard in state.shards:
            entry = {k: t.view(shard.shape).float().cpu().clone() for k, t in shard.tensors.items()}
            entry["step"] = state.own_step(shard)
            out[shard.name] = entry
        return out


class FP32Optimizer(_FullParamOptimizer):
    """fp32 params: the inner optimizer steps the model params themselves, with grad = main_grad (an alias)."""


class Float16OptimizerWithFloat16Params(_FullParamOptimizer):
    """fp16/bf16 params with full fp32 main copies held by the inner optimizer; step() casts them back."""
