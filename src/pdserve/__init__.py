"""pdserve: disaggregated prefill/decode LLM serving over NIXL, with heterogeneous tensor parallelism."""

from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":  # lazy: importing pdserve must not import torch
        from pdserve.llm import LLM
        return LLM
    raise AttributeError(name)
