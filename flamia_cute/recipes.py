"""Named quantization recipes (like torchao's float8 configs).

A Recipe says, per operand, which format and scale layout the kernels use, how
P and dS are cast, and which leakage safeguards apply. The emulator
(flamia_cute.emulator) defines exactly what each recipe computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

OPERAND_FORMATS = ("bf16", "e4m3", "e5m2", "mxfp8", "nvfp4")
SCALINGS = ("none", "tensor", "token", "tokenblock", "mx")
P_CASTS = ("bf16", "e4m3_fold", "mx")
# e4m3_tile: one power-of-two scale per (query_tile x key_tile) tile of dS * sq * sk, the same codes
# for dK and dQ; it LEAKS (a query's dQ codes depend on later queries' dS in its tile through the
# shared scale): a control for the leakage tests
DS_CASTS = ("bf16", "e4m3_rowtile", "e5m2_rowtile", "e4m3_tile", "mx")
DV_FOLDS = ("tile", "document")
# D = rowsum(dO * O) of the backward's dS = P (dP - D): from dO as given ("input"), or from dO's e4m3
# values, the dO that dP = dO V^T reads ("quantized"): then sum_j dS_ij stays ~0 under dO's rounding,
# so a large mean of K over the keys (a bias channel) cancels out of dQ = dS K as it does exactly
DELTAS = ("input", "quantized")
MX_BLOCK = 32  # Blackwell block-scaled MMA: one E8M0 scale per 32 elements
# P's e4m3_fold cast divides by a fold reference r (the max of the other operand's scales over the
# visible entries of a tile): r never goes below FOLD_REF_MIN, so that p_scale / r stays finite in
# fp32 (an all-zero row or tile has the scale 2^-126, and 256 / 2^-126 overflows). Backward (dV):
# r is clamped up to it. Forward (P V, where O is carried in units of the last tile's r): a tile
# whose r is below max(r_prev * FOLD_DROP, FOLD_REF_MIN) adds nothing to O and keeps r_prev, so
# that the rescale r_prev / r cannot overflow either (its V values are below 2^-24 of those
# already summed, or below 2^-110 absolute).
FOLD_REF_MIN = 2.0**-119
FOLD_DROP = 2.0**-24
NVFP4_BLOCK = 16


@dataclass(frozen=True)
class OperandQuant:
    """How one input operand (Q, K, V or dO) is quantized."""

    fmt: str = "e4m3"
    scaling: str = "token"
    block_tokens: int = 1

    def __post_init__(self):
        if self.fmt not in OPERAND_FORMATS:
            raise ValueError(f"OperandQuant.fmt must be one of {OPERAND_FORMATS}, got {self.fmt!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"OperandQuant.scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            raise ValueError(f"OperandQuant.block_tokens must be an int >= 1, got {self.block_tokens!r}")
        if (self.fmt == "bf16") != (self.scaling == "none"):
            raise ValueError("OperandQuant: fmt 'bf16' goes with scaling 'none' and only with it")
        if (self.fmt in ("mxfp8", "nvfp4")) != (self.scaling == "mx"):
            raise ValueError("OperandQuant: fmt 'mxfp8'/'nvfp4' goes with scaling 'mx' and only with it")
        if self.scaling == "token" and self.block_tokens != 1:
            raise ValueError("OperandQuant: scaling 'token' needs block_tokens=1 (use 'tokenblock')")
        if self.scaling == "tokenblock" and self.block_tokens == 1:
            raise ValueError("OperandQuant: scaling 'tokenblock' needs block_tokens > 1")

    @property
    def quantized(self) -> bool:
        return self.fmt != "bf16"


BF16_OPERAND = OperandQuant("bf16", "none")


@dataclass(frozen=True)
class Recipe:
    """A complete FP8 attention recipe, forward and backward.

    diagonal_safeguard: key-side scales shared by several keys (token blocks,
    MX blocks) would leak future keys into earlier queries on the diagonal
    tiles. With the safeguard, pairs whose key lies in the query's own scale
    block use a leak-free operand: per-token scales (tokenblock) or bf16 (MX).
    """

    name: str
    q: OperandQuant = field(default_factory=OperandQuant)
    k: OperandQuant = field(default_factory=OperandQuant)
    v: OperandQuant = field(default_factory=OperandQuant)
    do: OperandQuant = field(default_factory=OperandQuant)
    p_cast: str = "e4m3_fold"
    ds_cast: str = "e4m3_rowtile"
    diagonal_safeguard: bool = True
    key_tile: int = 128  # keys per tile: the granularity of P's scale fold and dS row scales
    query_tile: int = 128  # queries per backward tile: granularity of dS column scales and dV's P fold
    p_scale: float = 256.0  # fixed power of two: P * 256 <= 256 < 448, cannot saturate e4m3
    # dV = P^T dO with dO's per-token scale folded into P (p_cast e4m3_fold) relative to a reference:
    # "tile", the max over each query tile's visible queries; "document", one reference per (KV head
    # group, document), the max dO scale there: the same for every tile, so a kernel can accumulate
    # dV in the MMA itself
    dv_fold: str = "tile"
    # Q and K through a Walsh-Hadamard transform over the head dimension (rotary.py) before their
    # quantization: S is unchanged exactly, outlier channels are spread over all channels
    hadamard: bool = False
    delta: str = "input"  # DELTAS

    def __post_init__(self):
        if self.p_cast not in P_CASTS:
            raise ValueError(f"Recipe.p_cast must be one of {P_CASTS}, got {self.p_cast!r}")
        if self.ds_cast not in DS_CASTS:
            raise ValueError(f"Recipe.ds_cast must be one of {DS_CASTS}, got {self.ds_cast!r}")
        if self.dv_fold not in DV_FOLDS:
            raise ValueError(f"Recipe.dv_fold must be one of {DV_FOLDS}, got {self.dv_fold!r}")
        if self.delta not in DELTAS:
            raise ValueError(f"Recipe.delta must be one of {DELTAS}, got {self.delta!r}")
        for flag in ("hadamard", "diagonal_safeguard"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"Recipe.{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.dv_fold != "tile" and self.p_cast != "e4m3_fold":
            raise ValueError("Recipe.dv_fold 'document' applies to p_cast 'e4m3_fold' only")
        for tile_name in ("key_tile", "query_tile"):
            t = getattr(self, tile_name)
            if isinstance(t, bool) or not isinstance(t, int) or t < 1 or t & (t - 1):
                raise ValueError(f"Recipe.{tile_name} must be a power of two, got {t}")
        if not 0.0 < self.p_scale <= 448.0:  # NaN fails too
            raise ValueError(f"Recipe.p_scale must be in (0, 448] so P*scale cannot saturate e4m3, got {self.p_scale}")
        mx = [op.scaling == "mx" for op in self.operands()]
        if any(mx) and not all(mx):
            raise ValueError("Recipe: MX scaling applies to all of q, k, v, do or none")
        if any(mx) != (self.p_cast == "mx"):
            raise ValueError("Recipe: p_cast 'mx' goes with MX operands and only with them")
        if any(mx) != (self.ds_cast == "mx"):
            raise ValueError("Recipe: ds_cast 'mx' goes with MX operands and only with them")
        if self.q.scaling == "tokenblock" or self.do.scaling == "tokenblock":
            # A block of queries sharing a scale leaks into every tile (design note).
            raise ValueError("Recipe: query-side operands (q, do) must not use token-block scales")
        for side in ("k", "v"):
            op = getattr(self, side)
            if op.scaling == "tokenblock" and self.key_tile % op.block_tokens and op.block_tokens % self.key_tile:
                raise ValueError(f"Recipe.{side}.block_tokens must divide or be a multiple of key_tile")
        if self.uses_fp8 and self.k.scaling == "none":
            raise ValueError("Recipe: an FP8 recipe must quantize k")

    def operands(self):
        return (self.q, self.k, self.v, self.do)

    @property
    def uses_fp8(self) -> bool:
        return any(op.quantized for op in self.operands())

    @property
    def is_mx(self) -> bool:
        return self.p_cast == "mx"

    @classmethod
    def from_name(cls, name: str) -> Recipe:
        try:
            return NAMED_RECIPES[name]
        except KeyError:
            raise ValueError(f"recipe: unknown name {name!r}; named recipes: {sorted(NAMED_RECIPES)}") from None

    def with_(self, **changes) -> Recipe:
        return replace(self, **changes)


_TOKEN = OperandQuant("e4m3", "token", 1)
_TENSOR = OperandQuant("e4m3", "tensor", 1)
_BLOCK128 = OperandQuant("e4m3", "tokenblock", 128)
_MX = OperandQuant("mxfp8", "mx", 1)
_NVFP4 = OperandQuant("nvfp4", "mx", 1)

NAMED_RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("bf16", BF16_OPERAND, BF16_OPERAND, BF16_OPERAND, BF16_OPERAND, p_cast="bf16", ds_cast="bf16"),
        Recipe("fp8_token", _TOKEN, _TOKEN, _TOKEN, _TOKEN),
        Recipe("fp8_tokenblock", _TOKEN, _BLOCK128, _BLOCK128, _TOKEN),
        # Same as fp8_tokenblock without the diagonal safeguard: leaks, a control for the tests.
        Recipe("fp8_tokenblock_unsafe", _TOKEN, _BLOCK128, _BLOCK128, _TOKEN, diagonal_safeguard=False),
        Recipe("fp8_token_ds_e5m2", _TOKEN, _TOKEN, _TOKEN, _TOKEN, ds_cast="e5m2_rowtile"),
        Recipe("fp8_token_ds_bf16", _TOKEN, _TOKEN, _TOKEN, _TOKEN, ds_cast="bf16"),
        # The default: S, P V, dP and dV in FP8 with dV's dO scale folded per document, dS in bf16
        # for dK and dQ (the sm_90a backward kernel, sm90/attention_bwd.py). D from dO's e4m3 values,
        # the dO that dP reads: each row's dS then sums to ~0 as the exact one does (docs/numerics.md)
        Recipe("fp8_tokenblock_dsbf16", _TOKEN, _BLOCK128, _BLOCK128, _TOKEN, ds_cast="bf16", dv_fold="document",
               delta="quantized"),
        # The default with Q and K through a Walsh-Hadamard transform over the head dimension: the recipe
        # for heads with outlier channels (docs/rotations.md)
        Recipe("fp8_tokenblock_hadamard", _TOKEN, _BLOCK128, _BLOCK128, _TOKEN, ds_cast="bf16", dv_fold="document",
               hadamard=True, delta="quantized"),
        # One dS scale per 64-query x 128-key tile for both products (e4m3_tile). Leaks through dQ:
        # the control that shows the leakage tests see scales shared across queries in dS
        Recipe("fp8_tokenblock_dstile_unsafe", _TOKEN, _BLOCK128, _BLOCK128, _TOKEN, ds_cast="e4m3_tile",
               dv_fold="document", query_tile=64),
        # The default's numerics (but D from the bf16 dO) with one amax per tensor per call, as cuDNN's FP8
        # attention scales.
        # Deliberately leaky (every position's scale sees every other): the control of the leakage
        # tests, forward and backward, on the kernels and the emulator.
        Recipe("fp8_tensor_current", _TENSOR, _TENSOR, _TENSOR, _TENSOR, ds_cast="bf16", dv_fold="document",
               diagonal_safeguard=False),
        Recipe("mxfp8", _MX, _MX, _MX, _MX, p_cast="mx", ds_cast="mx"),
        Recipe("mxfp8_unsafe", _MX, _MX, _MX, _MX, p_cast="mx", ds_cast="mx", diagonal_safeguard=False),
        # FLAMIA's mixed path: NVFP4 (1x16 blocks, e4m3 block scales) for S = Q K^T, MXFP8 elsewhere.
        Recipe("nvfp4_fp8", _NVFP4, _NVFP4, _MX, _MX, p_cast="mx", ds_cast="mx"),
    )
}

# Against fp8_tokenblock (e4m3 dS): a faster backward kernel and a lower dQ error (docs/numerics.md)
DEFAULT_RECIPE = "fp8_tokenblock_dsbf16"


def resolve_recipe(recipe: str | Recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str):
        return Recipe.from_name(recipe)
    raise TypeError(f"recipe must be a name or a flamia_cute.Recipe, got {type(recipe).__name__}")
