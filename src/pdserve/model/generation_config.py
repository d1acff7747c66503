"""A checkpoint's `generation_config.json`: the sampling defaults its authors chose.

Server process (and `pdserve.LLM`). As vLLM applies them (`--generation-config auto`): a request
that leaves temperature, top_p, top_k, min_p, repetition_penalty or max_tokens unset gets the
checkpoint's value instead of pdserve's. The end-of-sequence ids it lists are read by spec.py. Fields pdserve cannot honour are
logged once, never fatal.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

_USED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_new_tokens": "max_tokens",
         "min_p": "min_p", "repetition_penalty": "repetition_penalty"}  # vLLM's get_diff_sampling_param
_UNSUPPORTED = {"presence_penalty": 0.0, "frequency_penalty": 0.0}  # not read by vLLM either
_KNOWN = {"eos_token_id", "bos_token_id", "pad_token_id", "do_sample", "transformers_version",
          "_from_model_config", "decoder_start_token_id", "use_cache", "max_length", "num_beams"}


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path, source: str = "auto") -> "GenerationDefaults":
        """`source` "auto" reads the checkpoint's file; "vllm" (or "none") keeps pdserve's defaults."""
        path = Path(model_dir) / "generation_config.json"
        if source != "auto" or not path.is_file():
            return cls()
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            logger.warning("generation_config.json ignored: %s", e)
            return cls()
        values = {}
        for key, value in cfg.items():
            if key in _USED and isinstance(value, (int, float)) and not isinstance(value, bool):
                values[_USED[key]] = value
            elif key in _UNSUPPORTED and value != _UNSUPPORTED[key]:
                logger.warning("generation_config.json: %s=%r is not supported by pdserve; ignored", key, value)
            elif key not in _KNOWN and key not in _USED and key not in _UNSUPPORTED:
                logger.info("generation_config.json: %s is not used by pdserve", key)
        defaults = cls(**values)
        if values:
            logger.info("sampling defaults from generation_config.json: %s", values)
        return defaults
