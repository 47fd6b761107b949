"""Training state that outlives a process: checkpoints (written to a temporary directory, renamed into
place), resuming, and the ranks of a torchrun job."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from flashdraft.models.draft import DFlashDraft
from flashdraft.models.target import Target
from flashdraft.train.config import RUN_FIELDS, TrainConfig, TrainError

STATE_NAME = "trainer_state.json"


OPTIM_NAME = "optimizer.safetensors"


RNG_NAME = "rng.safetensors"


STATE_FORMAT = "flashdraft-train/1"


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    enabled: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup(cfg: TrainConfig) -> tuple[Dist, torch.device]:
    """Process group (under torchrun) and device: gloo on CPU, NCCL on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if world <= 1:
        return Dist(), torch.device(want)
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if want.startswith("cuda"):
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(hours=3))
    return Dist(dist.get_rank(), dist.get_world_size(), local, True), device


def shard(draft: DFlashDraft, device: torch.device, d: Dist):
    """FSDP2: shard each draft layer, then the rest (fc, norms), across the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (d.world,))
    for layer in draft.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(draft, mesh=mesh)
    return draft


def all_sum(value: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled:
        import torch.distributed as dist

        dist.all_reduce(value)
    return value


def barrier(d: Dist) -> None:
    if d.enabled:
        import torch.distributed as dist

        dist.barrier()


def _state_options(d: Dist, **kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=d.enabled, **kw)


def unsharded(draft, d: Dist) -> DFlashDraft | None:
    """The whole draft on rank 0 (the module itself without torchrun; a gathered copy with FSDP,
    a collective call on every rank). Other ranks get None."""
    if not d.enabled:
        return draft
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(draft, options=_state_options(d))
    if not d.main:
        return None
    with torch.random.fork_rng(devices=[]):  # building a module draws its random init: keep the RNG as is
        copy = DFlashDraft(draft.config)
    copy.to(next(iter(state.values())).dtype).load_state_dict(
        state
    )  # cast first: loading copies into the dtype
    copy.set_vocab(draft.vocab, draft.vocab_rows)
    return copy


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint after `step` optimizer steps (zero-padded: sorts by step)."""
    return f"step-{step:08d}"


def checkpoint_dirs(out: Path) -> list[Path]:
    """Complete checkpoints (renamed into place, so complete by construction), oldest first."""
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / STATE_NAME).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


def read_state(ckpt: Path) -> dict:
    try:
        state = json.loads((ckpt / STATE_NAME).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TrainError(
            f"{ckpt / STATE_NAME} is unreadable ({e}): delete {ckpt} to resume from an older one"
        ) from None
    if state.get("format") != STATE_FORMAT:
        raise TrainError(f"{ckpt} was written by another trainer (format {state.get('format')!r})")
    return state


def target_fingerprint(target: Target) -> dict:
    w = target.embedding.weight
    rows = w[:: max(1, w.shape[0] // 256)].double()
    return {
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "head_layout": list(target.head_layout),
        "embedding_checksum": float(rows.abs().sum()),
    }


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_checkpoint(
    out: Path,
    step: int,
    draft,
    optimizer,
    d: Dist,
    state: dict,
    keep: int,
    files: dict[str, str] | None = None,
) -> Path | None:
    """Write OUT/checkpoints/step-N atomically (temp dir, then rename) and prune older ones; `files`: more
    text files for it (name -> text), such as the draft's lineage. A collective call under torchrun; only
    rank 0 writes."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    whole = unsharded(draft, d)
    optim = get_optimizer_state_dict(draft, optimizer, options=_state_options(d))
    final = None
    if d.main:
        root = out / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        final = root / checkpoint_name(step)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.", suffix=".tmp"))
        try:
            whole.save_pretrained(tmp)
            tensors = {}
            for fqn, entries in optim["state"].items():
                for name, value in entries.items():
                    tensors[f"{fqn}::{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
            save_file(tensors, str(tmp / OPTIM_NAME))
            rng = {"torch": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
            save_file(rng, str(tmp / RNG_NAME))
            py_state = random.getstate()
            state = dict(
                state,
                format=STATE_FORMAT,
                step=step,
                python_random=[py_state[0], list(py_state[1]), py_state[2]],
            )
            (tmp / STATE_NAME).write_text(json.dumps(state, indent=1) + "\n")
            for name, text in (files or {}).items():
                (tmp / name).write_text(text)
            for f in tmp.iterdir():
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
            os.chmod(tmp, 0o755)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in checkpoint_dirs(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(d)
    return final


def _set_moments(draft, optimizer, flat: dict[str, torch.Tensor], strict: bool = True) -> None:
    """AdamW's moments and step counts, saved flat as "<param fqn>::<name>", into `optimizer`; not
    `strict`: parameters missing from `flat` (a grown draft's new layers) start without."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, strict=strict)
    optim = get_optimizer_state_dict(draft, optimizer, options=opts)
    state: dict[str, dict] = {}
    for key, value in flat.items():
        fqn, name = key.rsplit("::", 1)
        state.setdefault(fqn, {})[name] = value
    set_optimizer_state_dict(
        draft, optimizer, {"state": state, "param_groups": optim["param_groups"]}, options=opts
    )
    for name, p in draft.named_parameters():  # torch fills in the missing with a step of zeros: undo
        if name not in state:
            optimizer.state.pop(p, None)


def carry_moments(ckpt: Path, draft, optimizer) -> str:
    """Continue a sitting's optimizer: the moments of a training checkpoint given as --init-draft, when it
    holds them. Without them every sitting restarts AdamW from zero, and held-out tau dips while the
    fresh moments settle. A grown draft (`--grow-to`) carries the moments of the parameters it grew from;
    its new layers start theirs at zero. Returns what happened, for the log."""
    path = ckpt / OPTIM_NAME
    if not path.is_file():
        return "fresh optimizer (no optimizer state beside --init-draft's weights)"
    flat = load_file(str(path))
    shapes = {n: tuple(p.shape) for n, p in draft.named_parameters()}
    saved = {k.rsplit("::", 1)[0]: tuple(v.shape) for k, v in flat.items() if k.endswith("::exp_avg")}
    if any(shapes.get(n) != shape for n, shape in saved.items()):
        return "fresh optimizer (--init-draft's optimizer state is for parameters of other shapes)"
    _set_moments(draft, optimizer, flat, strict=len(saved) == len(shapes))
    if len(saved) < len(shapes):
        return (
            f"optimizer moments carried from {path} for {len(saved)} of {len(shapes)} parameters "
            "(the grown layers' start at zero)"
        )
    return f"optimizer moments carried from {path}"


def load_checkpoint(ckpt: Path, draft, optimizer, d: Dist) -> None:
    """Weights, optimizer moments and RNG states of a checkpoint into this (possibly sharded) run."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    opts = StateDictOptions(full_state_dict=True)
    try:
        model = load_file(str(ckpt / "model.safetensors"))
        flat = load_file(str(ckpt / OPTIM_NAME))
        rng = load_file(str(ckpt / RNG_NAME))
    except (SafetensorError, OSError) as e:
        raise TrainError(
            f"checkpoint {ckpt} is damaged ({e}): delete it to resume from an older one"
        ) from None
    set_model_state_dict(draft, model, options=opts)
    _set_moments(draft, optimizer, flat)
    torch.set_rng_state(rng["torch"])
    cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    py = read_state(ckpt)["python_random"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def check_resume(state: dict, identity: dict, ckpt: Path) -> None:
    """Refuse a checkpoint made for another run (options, data, target or draft shape)."""
    old = state.get("identity", {})
    diffs = []
    # An option added after the checkpoint was made resumes as if it had had its default.
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    for k in RUN_FIELDS:
        a, b = old.get("config", {}).get(k, defaults[k]), identity["config"][k]
        if a != b:
            diffs.append(f"--{k.replace('_', '-')}: checkpoint {a!r}, now {b!r}")
    if "features" in identity["config"]:  # resolved once the target is loaded; older runs read transformers'
        a, b = old.get("config", {}).get("features", "transformers"), identity["config"]["features"]
        if a != b:
            diffs.append(f"--features: checkpoint {a!r}, now {b!r}")
    if old.get("data") != identity["data"]:
        diffs.append("the data files (content or order) differ from the checkpoint's")
    if old.get("held_out") != identity["held_out"]:
        diffs.append(f"held-out records: checkpoint {old.get('held_out')}, now {identity['held_out']}")
    for key in ("target", "draft_config"):
        if key in identity and old.get(key) != identity[key]:
            a, b = old.get(key) or {}, identity[key]
            if (
                key == "target"
                and a
                and {k: v for k, v in a.items() if k != "embedding_checksum"}
                == {k: v for k, v in b.items() if k != "embedding_checksum"}
                and math.isclose(a["embedding_checksum"], b["embedding_checksum"], rel_tol=1e-6)
            ):
                continue
            changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            diffs.append(f"{'target model' if key == 'target' else 'draft config'} differs in {changed}")
    if diffs:
        raise TrainError(
            f"cannot resume from {ckpt}: it belongs to a different run ({'; '.join(diffs)}). "
            "Resume with the same target, data and options, or train into a new --out"
        )
