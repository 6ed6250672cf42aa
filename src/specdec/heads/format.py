"""A draft head on disk: a folder with ``config.json`` (:class:`HeadConfig`) and
``head.safetensors`` (the weights, ``vocab_map`` included; the target's embedding is not
stored).

A head belongs to one target: ``config.json`` names it and holds a fingerprint of its
weights (:func:`target_fingerprint`), and :func:`load_head` refuses any other target with
one line saying which.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from specdec.heads.modules import KINDS, EagleHead, HeadConfig, MedusaHead, make_head

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "head.safetensors"

#: Heads shipped inside the package (``heads/data/FOLDER``), by kind.
SHIPPED = {
    "eagle": ("smollm2-135m-instruct-eagle",),
    "medusa": ("smollm2-135m-instruct-medusa",),
    "parallel": ("smollm2-135m-instruct-parallel",),
    "hydra": ("smollm2-135m-instruct-hydra",),
}


def target_fingerprint(view) -> str:
    """SHA-256 (first 16 hex digits) of the target's token embedding, LM head and final
    norm rounded to bfloat16, with its shape: the same for a model loaded in float32 or
    bfloat16, on either backend, different for another model.

    Args:
        view: the target's :class:`~specdec.models.base.HeadView`.
    """
    digest = hashlib.sha256()
    digest.update(f"{view.vocab_size}x{view.hidden_size}x{view.num_layers}".encode())
    tensors = [view.embed, view.norm]
    if view.lm_head.data_ptr() != view.embed.data_ptr():
        tensors.append(view.lm_head)
    for t in tensors:
        data = t.detach().to("cpu", torch.bfloat16).contiguous()
        digest.update(data.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def shipped_head_path(view, kind: str) -> Path | None:
    """The packaged ``kind`` head trained for this target (matched by weights
    fingerprint, so the embedded model loaded by name or from its file both find it), or
    ``None`` when none is shipped."""
    fingerprint = None
    for folder in SHIPPED.get(kind, ()):
        path = Path(__file__).parent / "data" / folder
        if not (path / CONFIG_FILE).is_file():
            continue
        config = read_config(path)
        fingerprint = fingerprint or target_fingerprint(view)
        if config.target_fingerprint == fingerprint:
            return path
    return None


def save_head(head: EagleHead | MedusaHead, folder: str | Path, dtype=torch.bfloat16) -> Path:
    """Write ``head`` to ``folder`` (created), weights in ``dtype``.

    Returns:
        the folder.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).contiguous()
        for name, t in head.state_dict().items()
    }
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"kind": head.config.kind})
    (folder / CONFIG_FILE).write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")
    return folder


def read_config(folder: str | Path) -> HeadConfig:
    """The :class:`HeadConfig` of a head folder.

    Raises:
        ValueError: not a head folder (one line naming what is missing or malformed).
    """
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise ValueError(f"head {folder} {what}; a head is a folder with {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE} (specdec train-head writes one)")  # fmt: skip
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise ValueError(f"head {folder} has no {name} (specdec train-head writes one)")
    try:
        data = json.loads(path.read_text("utf-8"))
        config = HeadConfig(**data)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
        raise ValueError(f"head {folder}: {CONFIG_FILE} is not a head config ({exc})") from None
    if config.kind not in KINDS:
        raise ValueError(f"head {folder}: unknown kind {config.kind!r}; known: {', '.join(KINDS)}")
    if config.format_version != 1:
        raise ValueError(f"head {folder}: format version {config.format_version} is not 1")
    return config


def check_target(config: HeadConfig, view, where: str = "the head") -> None:
    """Refuse a head trained for another target.

    Raises:
        ValueError: shape or fingerprint differs (one line naming both models).
    """
    shape = (config.vocab_size, config.hidden_size, config.num_layers)
    theirs = (view.vocab_size, view.hidden_size, view.num_layers)
    if shape != theirs or config.target_fingerprint != target_fingerprint(view):
        raise ValueError(
            f"{where} was trained for {config.target_name} (vocabulary, width, layers "
            f"{shape}, weights {config.target_fingerprint}), not for {view.name} ({theirs}, "
            f"weights {target_fingerprint(view)}); train one with: specdec train-head "
            f"--kind {config.kind} --model {view.name}"
        )


def _a(kind: str) -> str:
    """``"an eagle"`` / ``"a medusa"``."""
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


def load_head(
    folder: str | Path, view, kind: str | None = None, dtype: torch.dtype | None = None
) -> EagleHead | MedusaHead:
    """Load a head for the target ``view`` (:class:`~specdec.models.base.HeadView`),
    bound to its embedding, in ``dtype``, in eval mode. The default is float32 on CPU
    (PyTorch's one-row bfloat16 products run 2-3x slower there than float32 ones for the
    head's shapes, measured on this project's CPU) and the embedding's dtype elsewhere.

    Raises:
        ValueError: not a head folder, a head of another ``kind``, or one trained for
            another target.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_config(folder)
    if kind is not None and config.kind != kind:
        raise ValueError(f"head {folder} is {_a(config.kind)} head, not {kind}")
    check_target(config, view, f"head {folder}")
    head = make_head(config)
    try:
        state = load_file(str(Path(folder) / WEIGHTS_FILE))
        head.load_state_dict(state)
    except (SafetensorError, RuntimeError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"head {folder}: {WEIGHTS_FILE} does not match its config ({first})"
        ) from None
    if dtype is None:
        dtype = torch.float32 if view.embed.device.type == "cpu" else view.embed.dtype
    head = head.to(view.embed.device, dtype).eval()  # on the target's device
    if isinstance(head, EagleHead):
        head.inv_freq = head.inv_freq.float()  # rotary angles stay float32
    return head.bind(view.embed)
