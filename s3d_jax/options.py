"""What a decode request asks for: `DecodeOptions`, shared by `decode`, `stream`, the CLI and the
benchmarks, and the buckets its prompt and cache are padded to. Plain Python (no JAX), so a
benchmark's parent process can build one cheaply."""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers

from s3d_jax.config import ACTIVATION_MODES, DTYPES

METHODS = ("ar", "s3d", "selfspec")
DEFAULT_GAMMA = 4
# With a tree, draft only where the verifier picked x_n with at least this probability; elsewhere take
# one plain step. Chosen on a 2-core CPU, where a drafted tree costs about 2.4 plain steps (docs/experiments.md,
# "Drafting only where the text is predictable"); where verifying a few tokens costs about one step,
# as on a GPU, 0 drafts at every iteration.
DEFAULT_MIN_CERTAINTY = 0.9
MAX_TEMPERATURE = 3.4028234663852886e38  # float32's largest: sampling divides float32 logits by it
SEED_LIMIT = 2**32  # jax.random.key keeps only a seed's low 32 bits (without jax_enable_x64): 2**32 would equal 0


def bucket(n: int, minimum: int = 16) -> int:
    """Pads lengths to powers of two so that a new length seldom compiles again."""
    return max(minimum, 1 << (n - 1).bit_length())


PROMPT_STEPS = 4  # prompt buckets per doubling of length, past the first few
PROMPT_STEP_MIN = 32  # the finest step between prompt buckets, in tokens


def prompt_bucket(n: int) -> int:
    """A prompt's padded length: `bucket(n)`, or the next of `PROMPT_STEPS` steps in its octave (at
    least `PROMPT_STEP_MIN` apart). The prompt pass costs each padded token as much as a real one,
    and only it compiles per prompt bucket (in about a second; the loop's state is sized by the cache).
    A 260-token prompt runs as 320 tokens rather than 512 (docs/cpu.md, "Prompt buckets")."""
    top = bucket(n)
    step = max(top // (2 * PROMPT_STEPS), PROMPT_STEP_MIN)
    return min(top, -(-n // step) * step)


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How to decode. `gamma` and `skip` left as None take the checkpoint's recorded drafter
    defaults, else γ = 4 and the middle half of the layers (`default_skip`)."""

    method: str = "s3d"  # "ar" (plain), "s3d", or "selfspec"
    gamma: int | None = None  # draft tokens per iteration
    skip: tuple[int, int] | None = None  # inclusive range of layers the draft skips
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    seed: int = 0
    chat: bool = False  # apply the model's chat template to text prompts
    eos_token_ids: tuple[int, ...] | None = None  # None: the checkpoint's and the tokenizer's
    max_len: int | None = None  # cache positions; None: the smallest bucket that fits
    tree: int | None = None  # S3D only: verify a token tree of this many nodes; 0: the argmax chain; None: the drafter's
    lookup: bool | None = None  # with a tree: verify tokens copied from the context alone when they suffice; None: on whenever a tree is
    # With a tree: draft only where the verifier picked x_n with at least this probability, else one plain
    # step; None: DEFAULT_MIN_CERTAINTY for greedy decoding, 0 (always draft) for sampling.
    min_certainty: float | None = None

    def __post_init__(self):
        """Checks every field's type and range (what needs the model is checked by `api.prepare`)."""
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        def set_(name, value):  # normalised: numpy ints become ints, ints floats, lists tuples
            object.__setattr__(self, name, value)

        for name in ("gamma", "max_len"):  # None: chosen from the model
            if getattr(self, name) is not None:
                set_(name, check_int(name, getattr(self, name), 1))
        set_("max_new_tokens", check_int("max_new_tokens", self.max_new_tokens, 1))
        set_("top_k", check_int("top_k", self.top_k, 0))
        set_("seed", check_int("seed", self.seed, 0))
        if self.seed >= SEED_LIMIT:
            raise ValueError(f"seed must be < 2**32 (a JAX key keeps 32 bits of it), got {self.seed}")
        set_("temperature", check_float("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be at most {MAX_TEMPERATURE:g}, the largest float32, got {self.temperature:g}")
        set_("top_p", check_float("top_p", self.top_p))
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.tree is not None:
            set_("tree", check_int("tree", self.tree, 0))
        if self.tree and self.method != "s3d":
            raise ValueError(f"tree drafting builds on the S3D draft pass: it needs method 's3d', not {self.method!r}")
        if not isinstance(self.chat, bool):
            raise TypeError(f"chat must be True or False, got {self.chat!r}")
        if self.lookup is not None and not isinstance(self.lookup, bool):
            raise TypeError(f"lookup must be True or False, got {self.lookup!r}")
        if self.lookup and self.method != "s3d":
            raise ValueError(f"the context branch runs through an S3D token tree's slots: it needs method 's3d', not {self.method!r}")
        if self.min_certainty is not None:
            set_("min_certainty", check_float("min_certainty", self.min_certainty))
            if not 0.0 <= self.min_certainty <= 1.0:
                raise ValueError(f"min_certainty is a probability: it must be in [0, 1], got {self.min_certainty}")
            if self.min_certainty and self.method != "s3d":
                raise ValueError(f"min_certainty chooses between an S3D draft and a plain step: it needs method 's3d', not {self.method!r}")
        if self.skip is not None:
            if isinstance(self.skip, (str, bytes)) or not hasattr(self.skip, "__len__") or len(self.skip) != 2:
                raise TypeError(f"skip must be a pair of layer indices (l, h), got {self.skip!r}")
            set_("skip", tuple(check_int("skip", i, 0) for i in self.skip))
        if self.eos_token_ids is not None:
            if isinstance(self.eos_token_ids, (str, bytes)) or not hasattr(self.eos_token_ids, "__iter__"):
                raise TypeError(f"eos_token_ids must be a sequence of token ids, got {self.eos_token_ids!r}")
            set_("eos_token_ids", tuple(check_int("eos_token_ids", i, 0) for i in self.eos_token_ids))

    def replace(self, **changes) -> DecodeOptions:
        return dataclasses.replace(self, **changes)

    def plain(self) -> DecodeOptions:
        """The same decoding by plain steps (method ar, S3D's own choices dropped): a comparison's baseline."""
        return self.replace(method="ar", tree=None, lookup=None, min_certainty=None)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **changes) -> DecodeOptions:
        """Options from the flags that `add_arguments` defined."""
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**fields, **changes})


def check_int(name: str, value, low: int) -> int:
    """`value` as a Python int >= low; a bool, float or string is a TypeError, not truncated."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def check_float(name: str, value) -> float:
    """`value` as a finite Python float; NaN and infinity are errors."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def default_skip(num_layers: int) -> tuple[int, int]:
    """About half of the layers, centred: the paper's best region."""
    low = num_layers // 4
    return low, low + num_layers // 2 - 1


def add_arguments(parser: argparse.ArgumentParser, methods: bool = True) -> None:
    """The decoding flags, the same in every command line."""
    if methods:
        parser.add_argument("--method", choices=METHODS, default="s3d")
    parser.add_argument("--gamma", type=int, default=None, help="draft tokens per iteration (default: checkpoint's, else 4)")
    parser.add_argument("--skip", type=int, nargs=2, metavar=("L", "H"), default=None, help="inclusive range of skipped layers")
    parser.add_argument("--tree", type=int, default=None, metavar="N",
                        help="S3D: verify a token tree of N nodes from the draft's per-depth distributions (0: the chain)")
    parser.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                        help="with a tree: when the context's last tokens occurred before, verify the tokens that followed "
                             "them alone, with no draft pass (default: on with a tree)")
    parser.add_argument("--min-certainty", type=float, default=None, metavar="P",
                        help="with a tree: draft only where the model picked the last token with at least this probability, "
                             f"else take one plain step (default: {DEFAULT_MIN_CERTAINTY} greedy, 0 sampling; 0: always draft)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Which model to load, and which drafter to apply to it: the same in every command line."""
    parser.add_argument("--model", default=None,
                        help="converted model directory, or a model's name: smollm2-135m (the default), qwen2.5-coder-0.5b")
    parser.add_argument("--drafter", default="bundled",
                        help="drafter file to apply, or 'none' for the bare model (default: the drafter shipped with the "
                             "bundled model; none for --model)")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="draft over the drafter's N most frequent tokens (0: the full vocabulary; default: the drafter's)")
    parser.add_argument("--dtype", default=None, choices=tuple(DTYPES),
                        help="cast the weights on loading, or quantize the projections' (int8) (default: the checkpoint's own)")
    parser.add_argument("--activations", default="float32", choices=ACTIVATION_MODES,
                        help="int8: a quantized weight's products quantize the activations and sum integers on a CPU (faster, "
                             "slightly other numbers); float32 (default): as they are")
    parser.add_argument("--mesh", default=None, metavar="model=N[,data=M]",
                        help="split the model over N devices, tensor-parallel (default: one device)")


def load_arguments(args: argparse.Namespace) -> dict:
    """`s3d_jax.load` keywords from `add_model_arguments` flags (plain values: a benchmark sends them to a child)."""
    return {"path": args.model, "drafter": None if args.drafter == "none" else args.drafter, "draft_vocab_size": args.draft_vocab,
            "dtype": args.dtype, "mesh": args.mesh, "activations": args.activations}
