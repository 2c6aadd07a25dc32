"""Fine-tuning: where ``model.weights`` come from and how they are loaded, ``model.freeze``, and the
classifier head.

* ``model.weights`` is a torchvision weights name (``IMAGENET1K_V1``, ``DEFAULT``,
  ``ResNet50_Weights.IMAGENET1K_V2``), resolved through torchvision's own weight enums and read
  from torch's hub cache (``torch.hub.get_dir()/checkpoints/<file>``), downloaded there first when
  it is missing (and kept only when its SHA-256 starts with the hash prefix in torchvision's file
  name, as ``torch.hub.load_state_dict_from_url(check_hash=True)`` checks); or a local file: a
  plain state dict, a torchvision reference-script or timm checkpoint (``model`` / ``state_dict``
  key), a ``.safetensors`` file, or an hvdtrain checkpoint.
  Files are read with ``weights_only=True`` (nothing but tensors and plain values is unpickled).
* Rank 0 loads them into its freshly built model on a fresh run (never over a checkpoint being
  resumed); the broadcast of the initial state in ``resume.resume`` gives every rank
  the same parameters. Every tensor whose name and shape match is loaded; the classifier head is
  kept freshly initialized when its shape differs (another number of classes); any other tensor
  that does not fit stops the run with one line (a file of another architecture).
* ``model.freeze`` turns ``requires_grad`` off for matching parameters (before the optimizer is
  built, so they get no updates, no momentum and no weight decay) and keeps every BatchNorm layer
  whose parameters are all frozen in eval mode, also after the ``model.train()`` of each epoch:
  its running statistics stay those of the weights it came with.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..config import ConfigError, ModelConfig
from ..data.files.index import sha256_file
from .build import TIMM_PREFIX, classifier_name, import_timm

WEIGHT_FILE_SUFFIXES = (".pt", ".pth", ".pth.tar", ".bin", ".ckpt", ".safetensors")


class WeightsError(ConfigError):
    """``model.weights`` that cannot be found, read or fitted, as one line."""


# --- the classifier head ------------------------------------------------------------------------

def in_module(tensor_name: str, module_name: str) -> bool:
    return bool(module_name) and (tensor_name == module_name or tensor_name.startswith(module_name + "."))


# --- model.freeze ---------------------------------------------------------------------------------

def frozen_names(model: nn.Module, patterns: str, arch: str) -> set[str]:
    """The parameter names ``model.freeze`` selects. Patterns apply in order: ``name`` or a glob
    freezes a module (and everything in it) or a parameter, ``!pattern`` unfreezes, ``backbone``
    is every parameter outside the classifier head. A pattern that matches nothing is an error."""
    names = [name for name, _ in model.named_parameters()]
    head = classifier_name(model)
    frozen: set[str] = set()
    for raw in (part.strip() for part in patterns.split(",")):
        if not raw:
            continue
        pattern = raw[1:] if raw.startswith("!") else raw
        if pattern == "backbone":
            matched = {n for n in names if not in_module(n, head)}
        else:
            matched = {n for n in names if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(n, pattern + ".*")}
        if not matched:
            examples = ", ".join(dict.fromkeys(n.rsplit(".", 1)[0] for n in names[:1] + names[len(names) // 2:][:1]
                                               + names[-1:]))
            raise ConfigError(f"config key 'model.freeze': pattern '{raw}' matches no parameter of {arch} "
                              f"(module names look like {examples}; backbone = all but the head '{head}')")
        frozen = frozen - matched if raw.startswith("!") else frozen | matched
    return frozen


def apply_freeze(model: nn.Module, patterns: str, arch: str) -> str:
    """Freeze what ``patterns`` selects; returns the line that says what was frozen ("" for none)."""
    if not patterns.strip():
        return ""
    frozen = frozen_names(model, patterns, arch)
    params = dict(model.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    frozen_bn = [module for module in model.modules() if isinstance(module, _BatchNorm)
                 and any(True for _ in module.parameters()) and not any(p.requires_grad for p in module.parameters())]
    if frozen_bn:
        # model.train() (every epoch) sets training=True everywhere; this runs before each forward.
        def keep_in_eval(module: nn.Module, args: Any) -> None:
            if module.training:
                for bn in frozen_bn:
                    bn.training = False

        model.register_forward_pre_hook(keep_in_eval)
    trained = [name for name in params if name not in frozen]
    values = sum(params[name].numel() for name in frozen)
    total = sum(p.numel() for p in params.values())
    shown = ", ".join(trained[:6]) + (f" ... ({len(trained)})" if len(trained) > 6 else "")
    return (f"model.freeze: {len(frozen)} of {len(params)} parameter tensors frozen ({values:,} of {total:,} "
            f"values), {len(frozen_bn)} BatchNorm layers kept in eval mode; trained: {shown or 'nothing'}")


# --- model.weights --------------------------------------------------------------------------------

def looks_like_file(spec: str) -> bool:
    return os.sep in spec or spec.startswith((".", "~")) or spec.endswith(WEIGHT_FILE_SUFFIXES) or Path(spec).exists()


def torchvision_weights_file(arch: str, spec: str) -> tuple[Path, str]:
    """The hub-cache path of torchvision's file for weights name ``spec`` of ``arch``, and its URL."""
    from torchvision import models

    try:
        enum = models.get_model_weights(arch)
    except (ValueError, KeyError):
        raise WeightsError(f"config key 'model.weights': '{spec}' is not a file, and {arch} has no torchvision "
                           f"weights names") from None
    name = spec.rsplit(".", 1)[-1]
    if name not in enum.__members__:
        raise WeightsError(f"config key 'model.weights': '{spec}' is neither a file nor a weights name of {arch} "
                           f"({', '.join(enum.__members__)})")
    url = enum[name].url
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path), url


def fetch_torchvision_weights(arch: str, spec: str,
                              download: Callable[[str, str], None] | None = None) -> Path:
    """The cached file, downloaded into torch's hub cache when missing; offline, one line saying
    where to put it by hand. A download whose SHA-256 does not start with the prefix torchvision
    publishes in the file name (``resnet18-f37072fd.pth``) is deleted and refused in one line: it
    never reaches the cache, where later runs would load it unchecked."""
    path, url = torchvision_weights_file(arch, spec)
    if path.is_file():
        return path
    download = download or (lambda source, target: torch.hub.download_url_to_file(source, target, progress=False))
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        download(url, str(partial))
    except Exception as error:  # URLError, HTTPError, OSError, timeouts...
        partial.unlink(missing_ok=True)
        reason = (str(error).splitlines() or [type(error).__name__])[0][:100]
        raise WeightsError(f"model.weights={spec}: cannot download {path.name} ({reason}); fetch {url} on a machine "
                           f"with network and place it at {path}") from None
    expected = published_hash_prefix(path.name)
    digest = sha256_file(partial)
    if expected and not digest.startswith(expected):
        partial.unlink()
        raise WeightsError(f"model.weights={spec}: the download of {url} has SHA-256 {digest[:16]}..., not "
                           f"torchvision's {expected}... (a corrupted or tampered file; it was deleted): try "
                           f"again, or fetch it yourself, check it and place it at {path}")
    os.replace(partial, path)
    return path


def published_hash_prefix(file_name: str) -> str:
    """The SHA-256 prefix torchvision's weight files carry in their name (torch.hub's HASH_REGEX):
    ``resnet18-f37072fd.pth`` -> ``f37072fd``; "" for a name without one."""
    match = torch.hub.HASH_REGEX.search(file_name)
    return match.group(1) if match else ""


def timm_offline_hint(arch: str, spec: str) -> WeightsError:
    """timm's pretrained weights come from the Hugging Face hub: name the file to fetch instead."""
    timm = import_timm(arch)
    name = arch[len(TIMM_PREFIX):]
    cfg = timm.models.get_pretrained_cfg(name)
    where = (f"https://huggingface.co/{cfg.hf_hub_id}" if cfg and cfg.hf_hub_id else (cfg.url if cfg else "")) or \
        "the model's page on huggingface.co/timm"
    return WeightsError(f"config key 'model.weights': '{spec}' is not a file; timm weights are not downloaded by "
                        f"hvdtrain: fetch model.safetensors (or pytorch_model.bin) from {where} and set "
                        f"model.weights=/path/to/that/file")


def read_weights_file(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict a file holds, and what kind of file it was."""
    if not path.is_file():
        raise WeightsError(f"config key 'model.weights': file '{path}' does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path)), "safetensors file"
        # timm's train.py stores its argparse.Namespace; that one class is harmless to rebuild.
        with torch.serialization.safe_globals([argparse.Namespace]):
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except ImportError:
        raise WeightsError(f"model.weights: reading '{path}' needs safetensors (pip install safetensors)") from None
    except Exception as error:
        reason = (str(error).splitlines() or [type(error).__name__])[0][:120]
        raise WeightsError(f"config key 'model.weights': '{path}' is unreadable ({reason})") from None
    return extract_state_dict(payload, path)


def extract_state_dict(payload: Any, path: Path) -> tuple[dict[str, torch.Tensor], str]:
    is_checkpoint = isinstance(payload, dict) and "config" in payload and "step" in payload
    if is_checkpoint and isinstance(payload.get("model"), dict):
        state, kind = payload["model"], "hvdtrain checkpoint"
    elif isinstance(payload, dict) and isinstance(payload.get("state_dict"), dict):
        state, kind = payload["state_dict"], "checkpoint (state_dict)"   # timm's train.py, Lightning
    elif isinstance(payload, dict) and isinstance(payload.get("model"), dict):
        state, kind = payload["model"], "checkpoint (model)"             # torchvision's reference scripts
    else:
        state, kind = payload, "state dict"
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        keys = ", ".join(list(payload)[:6]) if isinstance(payload, dict) else type(payload).__name__
        raise WeightsError(f"config key 'model.weights': '{path}' holds no state dict of tensors (found: {keys})")
    cleaned = {}
    for key, value in state.items():
        for prefix in ("module.", "_orig_mod."):
            while key.startswith(prefix):
                key = key[len(prefix):]
        cleaned[key] = value
    return cleaned, kind


def resolve_weights(model_cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, description of its source) for ``model.weights``."""
    spec, arch = model_cfg.weights, model_cfg.arch
    if looks_like_file(spec):
        state, kind = read_weights_file(Path(spec).expanduser())
        return state, f"{kind} {spec}"
    if arch.startswith(TIMM_PREFIX):
        raise timm_offline_hint(arch, spec)
    path = fetch_torchvision_weights(arch, spec)
    return torch.load(path, map_location="cpu", weights_only=True), f"torchvision {spec} ({path})"


def fit_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str, arch: str) -> str:
    """Copy every fitting tensor of ``state`` into ``model``; the head is kept fresh when its shape
    differs. Returns the one line saying what was loaded, replaced and missing."""
    own = model.state_dict()
    head = classifier_name(model)
    param_names = {name for name, _ in model.named_parameters()}
    loaded: list[str] = []
    replaced: list[str] = []
    missing: list[str] = []
    misfit: list[str] = []
    for key, value in own.items():
        source_value = state.get(key)
        if source_value is None:
            (replaced if in_module(key, head) else missing).append(key)
        elif source_value.shape != value.shape:
            (replaced if in_module(key, head) else misfit).append(key)
        else:
            loaded.append(key)
    unused = [key for key in state if key not in own]
    lost = misfit + [key for key in missing if key in param_names]
    # Tensors of the file that the model lacks, outside the head: a deeper or other model (resnet34's
    # extra blocks fit resnet18's names and shapes, but loading half of it is not fine-tuning it).
    extra = [key for key in unused if not in_module(key, head)]
    if extra and not lost:
        raise WeightsError(f"model.weights: {source} does not fit model.arch={arch}: it has {len(extra)} tensors the "
                           f"model lacks (e.g. '{extra[0]}'); is it a checkpoint of another architecture?")
    if lost:
        key = lost[0]
        found = f"shape {list(state[key].shape)} in the file, {list(own[key].shape)} in the model" if key in state \
            else "not in the file"
        raise WeightsError(f"model.weights: {source} does not fit model.arch={arch}: {len(lost)} tensors do not "
                           f"(e.g. '{key}': {found}); is it a checkpoint of another architecture?")
    with torch.no_grad():
        for key in loaded:
            own[key].copy_(state[key])
    head_note = (f"replaced {head} (new, {tuple(own[head + '.weight'].shape)[0] if head + '.weight' in own else '?'}"
                 f" outputs)" if replaced else f"kept {head}")
    return (f"weights from {source}: loaded {len(loaded)} of {len(own)} tensors, {head_note}, "
            f"missing {len(missing)}{' (' + ', '.join(missing[:3]) + ')' if missing else ''}, "
            f"unused {len(unused)}{' (' + ', '.join(unused[:3]) + ')' if unused else ''}")


def load_weights(model: nn.Module, model_cfg: ModelConfig) -> str:
    """Rank 0, fresh runs: ``model.weights`` into ``model``; the line to log."""
    state, source = resolve_weights(model_cfg)
    return fit_weights(model, state, source, model_cfg.arch)
