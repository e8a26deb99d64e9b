"""Hugging Face checkpoint I/O for the target model, without transformers.

A checkpoint is a local folder in transformers' layout: `config.json` plus `model.safetensors`,
or `model.safetensors.index.json` and the shards it names. `load_checkpoint` reads it into a
`tlt_core.model.Transformer` (parameter names map 1:1) and checks every name and shape first;
`save_checkpoint` writes one that both it and `transformers.AutoModelForCausalLM` load. Nothing
here downloads: a hub model must be fetched into a folder beforehand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tlt_core.model.placement import DEVICES, resolve_placement
from tlt_core.model.transformer import ModelConfig, Transformer, rope_inv_freq
from tlt_core.model.weight_layout import physical_memory_bytes
from tlt_core.persistence.checkpoint_io import write_safetensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHOW_NAMES = 5  # names listed in an error before "..."


def load_checkpoint(path: str | Path, *, dtype: torch.dtype | str = torch.float32,
                    device: torch.device | str = "cpu") -> Transformer:
    """The model stored in the HF folder `path`, its weights cast to `dtype` on `device`: torch
    objects, or the names `--dtype` / `--device` take (tlt_core.model.placement; "auto" dtype
    is chosen for the device)."""
    dtype, device = _torch_dtype_and_device(dtype, device)
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"path: checkpoint folder {folder} does not exist")
    config = _read_config(folder / CONFIG_FILE)
    _refuse_what_cannot_fit(config, dtype, device, folder / CONFIG_FILE)
    # Built on the meta device: no memory, no random init; load_state_dict(assign=True) then
    # installs the checkpoint's tensors as the parameters.
    with torch.device("meta"):
        model = Transformer(config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]  # stored once, as model.embed_tokens.weight

    state, unexpected = {}, []
    for file, names in _weight_files(folder).items():
        tensors, ignored = _read_tensors(file, names, expected, dtype, device)
        state.update(tensors)
        unexpected += ignored
    missing = [name for name in expected if name not in state]
    if missing:
        raise ValueError(f"{folder}: lacks {len(missing)} tensor(s) the config needs: "
                         f"{_names(missing)}")
    if unexpected:  # another architecture, or a config that does not describe these weights
        raise ValueError(f"{folder}: {len(unexpected)} tensor(s) the config has no place for: "
                         f"{_names(unexpected)}")
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.model.rotary_emb.inv_freq = rope_inv_freq(config, device)  # the one tensor not stored
    if device.type != "cpu":  # the views layout there: fused, never copied
        model.fuse_projections_()
    return model.eval()


def save_checkpoint(model: Transformer, path: str | Path, *,
                    extra_config: dict[str, Any] | None = None) -> None:
    """Writes config.json (the model's config, then `extra_config` over it, e.g. token ids) and
    model.safetensors into `path` (created if needed). Tied embeddings are stored once."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_hf_config()
    config["torch_dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    config.update(extra_config or {})
    state = {name: _own_storage(tensor.detach().to("cpu"))
             for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(state, folder / WEIGHTS_FILE, {"format": "pt"})


def _torch_dtype_and_device(dtype: torch.dtype | str, device: torch.device | str
                            ) -> tuple[torch.dtype, torch.device]:
    """(dtype, device) as torch objects: placement names go through resolve_placement (its
    errors name the argument); torch objects and device strings such as "cuda:1" are kept."""
    if isinstance(device, str) and device in DEVICES:
        device = resolve_placement(device, "float32").device  # CUDA checked, LOCAL_RANK's index
    else:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device: expected one of {DEVICES} or a torch device, got "
                             f"{device!r}") from err
    if not isinstance(dtype, torch.dtype):  # a name; auto's choice depends on the device type
        dtype = resolve_placement(device.type, dtype).dtype
    return dtype, device


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """tensor, copied when it is a view into a larger storage (fused projections): safetensors
    refuses tensors that share memory."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _read_tensors(file: Path, names: list[str] | None, expected: dict[str, tuple[int, ...]],
                  dtype: torch.dtype, device: torch.device | str
                  ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The expected tensors among `names` (None: all) in one file, shapes checked before any
    is read, and the names that are neither expected nor ignorable."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            stored = set(reader.keys())
            names = sorted(stored) if names is None else names
            absent = [name for name in names if name not in stored]
            if absent:
                raise ValueError(f"{file}: lacks {_names(absent)}, which {INDEX_FILE} places there")
            # transformers < 4.31 stored RoPE frequencies; tied checkpoints may store lm_head.
            names = [name for name in names if not name.endswith("rotary_emb.inv_freq")
                     and (name in expected or name != "lm_head.weight")]
            for name in names:
                shape = tuple(reader.get_slice(name).get_shape())
                if name in expected and shape != expected[name]:
                    raise ValueError(f"{file}: tensor {name} has shape {shape}, the config "
                                     f"needs {expected[name]}")
            tensors = {name: reader.get_tensor(name).to(device=device, dtype=dtype)
                       for name in names if name in expected}
    except SafetensorError as err:
        raise ValueError(f"{file}: not a readable safetensors file ({err})") from err
    return tensors, [name for name in names if name not in expected]


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:SHOW_NAMES])
    return shown + (f", ... ({len(names) - SHOW_NAMES} more)" if len(names) > SHOW_NAMES else "")


def _read_config(file: Path) -> ModelConfig:
    """The model config in config.json `file`; a bad field's error names the field and file."""
    hf = _read_json(file)
    try:
        return ModelConfig.from_hf_config(hf)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{err} (in {file})") from err


def _refuse_what_cannot_fit(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                            file: Path) -> None:
    """Refuses, before anything is built, a config whose parameters alone exceed the device's
    memory: a typo such as num_hidden_layers 10**7 would otherwise spend minutes building a
    model that cannot load."""
    if device.type == "cpu":
        memory = physical_memory_bytes()
    elif device.type == "cuda" and torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = None
    needed = config.num_parameters() * dtype.itemsize
    if memory is not None and needed > memory:
        raise ValueError(
            f"{file}: the config describes {config.num_parameters():,} parameters "
            f"({needed / 2**30:,.1f} GiB in {dtype}), more than the {device} memory "
            f"({memory / 2**30:,.1f} GiB); check num_hidden_layers ({config.num_layers}), "
            f"hidden_size ({config.hidden_size}), intermediate_size "
            f"({config.intermediate_size}), vocab_size ({config.vocab_size}), "
            f"num_attention_heads ({config.num_heads}) and head_dim ({config.head_dim})")


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise FileNotFoundError(f"{file.name}: {file} does not exist")
    try:
        value = json.loads(file.read_bytes().decode("utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{file}: must hold a JSON object, got {type(value).__name__}")
    return value


def _weight_files(folder: Path) -> dict[Path, list[str] | None]:
    """Each safetensors file and the tensor names it holds (None: whatever the file has)."""
    if (folder / INDEX_FILE).is_file():
        weight_map = _read_json(folder / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{folder / INDEX_FILE}: has no weight_map")
        files: dict[Path, list[str]] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard:
                raise ValueError(f"{folder / INDEX_FILE}: weight_map[{name!r}] must be a file "
                                 f"name, got {shard!r}")
            files.setdefault(folder / shard, []).append(name)
    elif (folder / WEIGHTS_FILE).is_file():
        files = {folder / WEIGHTS_FILE: None}
    else:
        raise FileNotFoundError(f"{WEIGHTS_FILE}: {folder} has neither {WEIGHTS_FILE} nor "
                                f"{INDEX_FILE}")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file.name}: shard named by {INDEX_FILE} does not exist "
                                    f"in {folder}")
    return files
