"""What a decode request asks for: `DecodeOptions`, shared by `decode`, `stream`, the CLI and the
benchmarks. Plain Python (no JAX), so a benchmark's parent process can build one cheaply."""

from __future__ import annotations

import argparse
import dataclasses

METHODS = ("ar", "s3d", "selfspec")
DEFAULT_GAMMA = 4


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

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.skip is not None:
            object.__setattr__(self, "skip", tuple(self.skip))
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    def replace(self, **changes) -> DecodeOptions:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **changes) -> DecodeOptions:
        """Options from the flags that `add_arguments` defined."""
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**fields, **changes})


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
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
