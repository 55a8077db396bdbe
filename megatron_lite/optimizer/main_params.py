"""Main params: the fp32 tensors the inner optimizer steps for the model's data, and the copies between them.

    model data fp32              -> the main param is the model's tensor itself (the update lands in place)
    model data fp16/bf16         -> an fp32 copy, cast back into the model after every step
    optimizer_cpu_offload        -> an fp32 copy in (pinned) host memory, for the planned share (cpu_offload.py)

Shared by the full-parameter optimizers (a whole parameter each) and the distributed optimizer (the rank's
shard of a param buffer).
"""

from typing import List

import torch

from .cpu_offload import host_main_param, offload_plan
from .optimizer_config import OptimizerConfig


def main_param(model_data: torch.Tensor) -> torch.nn.Parameter:
    """The fp32 tensor the inner optimizer steps for `model_data` (a parameter, or a rank's shard of a
    param buffer): fp32 data itself, so the update lands in the model in place; else an fp32 copy."""
    if model_data.dtype == torch.float32:
        return model_data if isinstance(model_data, torch.nn.Parameter) else torch.nn.Parameter(model_data)
    return torch.nn.Parameter(model_data.detach().float())  # .float() of another dtype is a new tensor


def main_params(model_datas: List[torch.Tensor], config: OptimizerConfig) -> List[torch.nn.Parameter]:
    """main_param of each of `model_datas` (in the inner optimizer's order), except that with
    config.optimizer_cpu_offload the planned share of them is an fp32 copy in host memory (cpu_offload.py)."""
    on_host = [False] * len(model_datas)
    if config.optimizer_cpu_offload:
        on_host = offload_plan(model_datas, config.optimizer_offload_fraction)
    return [host_main_param(t) if host else main_param(t) for t, host in zip(model_datas, on_host)]


def _is_model_data(main: torch.Tensor, model_data: torch.Tensor) -> bool:
    return main.device == model_data.device and main.data_ptr() == model_data.data_ptr()


def copy_main_to_model(main: torch.Tensor, model_data: torch.Tensor):
    """Write an updated main param back into the model (a cast, or a copy from host memory); nothing to do
    when it is the model's data. From pinned host memory the copy is asynchronous: later work on the
    device (the parameter all-gather) is queued behind it."""
    if not _is_model_data(main, model_data):
        from_host = main.device.type == "cpu" and model_data.device.type != "cpu"
        model_data.copy_(main.detach().view_as(model_data), non_blocking=from_host and main.is_pinned())


def copy_model_to_main(model_data: torch.Tensor, main: torch.Tensor):
    """The reverse of copy_main_to_model: the model's values into its fp32 main copy."""
    if not _is_model_data(main, model_data):
        main.data.copy_(model_data.view_as(main))
